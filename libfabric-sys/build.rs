//! Generates the libfabric bindings against the headers pkg-config finds and
//! compiles `shim.c`, which gives libfabric's `static inline` calls real symbols.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=shim.h");
    println!("cargo:rerun-if-changed=shim.c");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let lib = pkg_config::Config::new().atleast_version("1.17").probe("libfabric").unwrap_or_else(|err| {
        panic!(
            "libfabric-sys: libfabric >= 1.17 was not found by pkg-config ({err}).\n\
                 On Debian/Ubuntu install it with: apt-get install -y libfabric-dev pkg-config"
        )
    });

    let mut shim = cc::Build::new();
    shim.file("shim.c").warnings(true);
    for path in &lib.include_paths {
        shim.include(path);
    }
    shim.compile("icheck_fabric_shim");

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("fi_(getinfo|freeinfo|dupinfo|allocinfo|fabric|strerror|version|tostr)")
        .allowlist_function("icheck_.*")
        .allowlist_type("fi_.*")
        .allowlist_type("fid.*")
        .allowlist_var("FI_.*")
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder
        .generate()
        .expect("libfabric-sys: bindgen could not parse the libfabric headers (is libclang-dev installed?)");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings.write_to_file(out.join("bindings.rs")).expect("libfabric-sys: could not write bindings.rs");
}
