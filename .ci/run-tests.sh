# Sourced by .ci/test and .ci/test-libfabric2.
# have_nextest: whether cargo-nextest is installed.
have_nextest() {
    cargo nextest --version > /dev/null 2>&1
}

# run_tests ARGS...: runs the tests `cargo test ARGS` would run, through
# cargo-nextest where the machine has it (one process per test, scheduled
# across all test binaries by .config/nextest.toml: the main pass took
# 12.6-14.4 minutes in three runs against 17.4), else through cargo test.
# Name filters go after `--` (`--skip NAME`), which both understand. Never
# stops at the first failure. nextest runs no doc-tests.
run_tests() {
    if have_nextest; then
        cargo nextest run --no-fail-fast "$@"
    else
        echo "run_tests: cargo-nextest not found; running the tests with cargo test (slower)" >&2
        cargo test --no-fail-fast "$@"
    fi
}

# test_totals LOG: the passed and failed counts of every libtest and
# nextest summary in LOG, as "N passed, M failed".
test_totals() {
    awk '/^test result:|^ *Summary \[/ {
             for (i = 1; i < NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i }
         }
         END { printf "%d passed, %d failed\n", p, f }' "$1"
}
