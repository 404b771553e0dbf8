/*
 * Every error path of the C API, in a program without MPI: each wrong call
 * must return its code (never crash) and leave the checkpoint intact.
 *
 *   cc -std=c99 errors.c -o errors $(pkg-config --cflags --libs icheck)
 *   ICHECK_CONFIG=<service config> ./errors <config naming an unreachable controller>
 *
 * Prints "ALL ERROR PATHS OK" and exits 0, or names the first failed check.
 */
#include <icheck.h>

#include <stdio.h>
#include <string.h>
#include <time.h>

static int failures = 0;

static void expect(int got, int want, const char *what)
{
    if (got != want) {
        const char *detail = icheck_last_error();
        printf("FAILED: %s returned %d (%s), expected %d (%s); last error: %s\n", what, got, icheck_strerror(got),
               want, icheck_strerror(want), detail ? detail : "(none)");
        failures++;
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: ICHECK_CONFIG=<config> %s <config with an unreachable controller>\n", argv[0]);
        return 2;
    }
    double values[100], back[100];
    long step = 7;
    int status = -1;
    for (int i = 0; i < 100; i++) values[i] = i * 0.5;

    /* Before init: everything is out of order, nothing crashes. */
    expect(icheck_commit(), ICHECK_ERR_ORDER, "commit before init");
    expect(icheck_add("x", values, 100, ICHECK_DOUBLE), ICHECK_ERR_ORDER, "add before init");
    expect(icheck_restart(), ICHECK_ERR_ORDER, "restart before init");
    expect(icheck_restore("x", back, 100), ICHECK_ERR_ORDER, "restore before init");
    expect(icheck_wait(), ICHECK_ERR_ORDER, "wait before init");
    expect(icheck_finalize(IC_CLEANUP), ICHECK_ERR_ORDER, "finalize before init");

    /* Bad init arguments. */
    expect(icheck_init_serial(NULL, NULL, &status), ICHECK_ERR_NULL, "init with NULL app_name");
    expect(icheck_init_serial(NULL, "errors", NULL), ICHECK_ERR_NULL, "init with NULL status");
    expect(icheck_init_serial("/nonexistent/icheck.toml", "errors", &status), ICHECK_ERR_CONFIG,
           "init with a missing config file");
    if (!icheck_last_error() || !strstr(icheck_last_error(), "/nonexistent/icheck.toml")) {
        printf("FAILED: the config error does not name the file: %s\n", icheck_last_error());
        failures++;
    }
    time_t start = time(NULL);
    expect(icheck_init_serial(argv[1], "errors", &status), ICHECK_ERR_CONTROLLER, "init with an unreachable controller");
    if (time(NULL) - start > 10) {
        printf("FAILED: init with an unreachable controller took %ld s\n", (long)(time(NULL) - start));
        failures++;
    }

    /* A real session. */
    expect(icheck_init_serial(NULL, "errors", &status), ICHECK_SUCCESS, "init");
    expect(status, ICHECK_FRESH, "status of a fresh application");
    expect(icheck_init_serial(NULL, "errors", &status), ICHECK_ERR_ORDER, "init twice");
    expect(icheck_add(NULL, values, 100, ICHECK_DOUBLE), ICHECK_ERR_NULL, "add with NULL label");
    expect(icheck_add("x", NULL, 100, ICHECK_DOUBLE), ICHECK_ERR_NULL, "add with NULL data");
    expect(icheck_add("x", values, 100, 42), ICHECK_ERR_ARG, "add with an unknown type");
    expect(icheck_add("", values, 100, ICHECK_DOUBLE), ICHECK_ERR_ARG, "add with an empty label");
    expect(icheck_restore("x", back, 100), ICHECK_ERR_ORDER, "restore before restart");
    expect(icheck_restart(), ICHECK_ERR_NO_CHECKPOINT, "restart without a checkpoint");
    /* Malleability: bad declarations name what is wrong. */
    expect(icheck_add_adapt_global("g", values, 100, ICHECK_DOUBLE, 100, 9, 0, NULL), ICHECK_ERR_ARG,
           "add_adapt_global with an unknown distribution");
    expect(icheck_add_adapt_global("g", values, 100, ICHECK_DOUBLE, 100, ICHECK_CYCLIC, 0, NULL), ICHECK_ERR_ARG,
           "CYCLIC with width 0");
    expect(icheck_add_adapt_global("g", values, 100, ICHECK_DOUBLE, 100, ICHECK_PREDEFINED, 0, NULL),
           ICHECK_ERR_NULL, "PREDEFINED without a pmap");
    expect(icheck_add_adapt_global("g", values, 99, ICHECK_DOUBLE, 100, ICHECK_BLOCK, 0, NULL), ICHECK_ERR_ADAPT,
           "a BLOCK part of the wrong length");
    if (!icheck_last_error() || !strstr(icheck_last_error(), "\"g\"") || !strstr(icheck_last_error(), "99")) {
        printf("FAILED: the part error does not name the label and count: %s\n", icheck_last_error());
        failures++;
    }
    icheck_pmap *pmap = icheck_pmap_create(10, 10);
    int grid[2] = {2, 3};
    expect(icheck_add_processor_mapping(4, grid, 100, pmap), ICHECK_ERR_ARG, "a 2x3 grid for 4 processes");
    grid[0] = 1; grid[1] = 2;
    expect(icheck_add_processor_mapping(2, grid, 100, pmap), ICHECK_SUCCESS, "a 1x2 grid for 2 processes");
    expect(icheck_add_adapt_global("g", values, 100, ICHECK_DOUBLE, 100, ICHECK_PREDEFINED, 0, pmap), ICHECK_ERR_RANKS,
           "PREDEFINED without a grid for this process count");
    if (!icheck_last_error() || !strstr(icheck_last_error(), "[2]")) {
        printf("FAILED: the mapping error does not name the supported counts: %s\n", icheck_last_error());
        failures++;
    }
    icheck_pmap_free(pmap);
    expect(icheck_add_adapt("s", &step, 1, ICHECK_LONG, ICHECK_DEFAULT, NULL, NULL, NULL), ICHECK_ERR_NULL,
           "DEFAULT without a value");
    expect(icheck_add_adapt("s", &step, 1, ICHECK_LONG, ICHECK_VOLATILE, NULL, NULL, NULL), ICHECK_ERR_ADAPT,
           "VOLATILE without a function");
    expect((int)icheck_local_count("values"), ICHECK_ERR_ORDER, "local_count before restart");
    expect(icheck_add("values", values, 100, ICHECK_DOUBLE), ICHECK_SUCCESS, "add values");
    expect(icheck_add("step", &step, 1, ICHECK_LONG), ICHECK_SUCCESS, "add step");
    expect(icheck_commit(), ICHECK_SUCCESS, "commit");
    expect(icheck_probe_agents(NULL), ICHECK_SUCCESS, "probe with NULL hints");
    /* Redundancy: the service's default is "none", so nothing is protected. */
    int64_t protected_version = -1;
    expect(icheck_protected_version(NULL), ICHECK_ERR_NULL, "protected_version with NULL");
    expect(icheck_protected_version(&protected_version), ICHECK_SUCCESS, "protected_version");
    expect((int)protected_version, 0, "protected version without redundancy");
    expect(icheck_wait_protected(0, 1.0), ICHECK_ERR_ARG, "wait_protected for version 0");
    if (icheck_wait_protected(1, 1.0) == ICHECK_SUCCESS || !strstr(icheck_last_error(), "\"none\"")) {
        printf("FAILED: waiting for protection under \"none\" does not say why: %s\n", icheck_last_error());
        failures++;
    }
    expect(icheck_finalize(7), ICHECK_ERR_ARG, "finalize with an unknown mode");
    expect(icheck_finalize(IC_PERSIST), ICHECK_SUCCESS, "finalize (persist)");
    expect(icheck_finalize(IC_PERSIST), ICHECK_ERR_ORDER, "double finalize");
    expect(icheck_commit(), ICHECK_ERR_ORDER, "commit after finalize");

    /* Restart: wrong restores fail, the checkpoint stays intact. */
    expect(icheck_init_serial(NULL, "errors", &status), ICHECK_SUCCESS, "init again");
    expect(status, ICHECK_RESTART, "status after a persisted run");
    expect(icheck_restart(), ICHECK_SUCCESS, "restart");
    expect(icheck_restore("nope", back, 100), ICHECK_ERR_LABEL, "restore of an unknown label");
    expect(icheck_restore("values", back, 99), ICHECK_ERR_SIZE, "restore with a wrong count");
    if (!icheck_last_error() || !strstr(icheck_last_error(), "values") || !strstr(icheck_last_error(), "800")) {
        printf("FAILED: the size error does not name the label and sizes: %s\n", icheck_last_error());
        failures++;
    }
    expect(icheck_restore(NULL, back, 100), ICHECK_ERR_NULL, "restore with NULL label");
    expect(icheck_restore("values", NULL, 100), ICHECK_ERR_NULL, "restore into NULL");
    memset(back, 0, sizeof back);
    step = 0;
    expect(icheck_restore("values", back, 100), ICHECK_SUCCESS, "restore values");
    expect(icheck_restore("step", &step, 1), ICHECK_SUCCESS, "restore step");
    if (memcmp(back, values, sizeof back) != 0 || step != 7) {
        printf("FAILED: restored data differs\n");
        failures++;
    }
    expect(icheck_finalize(IC_CLEANUP), ICHECK_SUCCESS, "finalize (cleanup)");

    for (int code = ICHECK_ERR_ACCESS - 1; code <= 0; code++) {
        const char *text = icheck_strerror(code);
        if (!text || !*text) {
            printf("FAILED: icheck_strerror(%d) is empty\n", code);
            failures++;
        }
    }
    if (failures) {
        printf("%d error path(s) failed\n", failures);
        return 1;
    }
    printf("ALL ERROR PATHS OK\n");
    return 0;
}
