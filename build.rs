//! Build script: only does work for the `gloo` feature, compiling the C++
//! shim over Debian's libgloo-dev (headers in /usr/include/gloo, library
//! libgloo.so). Without that feature it does nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "gloo")]
    {
        println!("cargo:rerun-if-changed=src/backends/gloo/shim.cc");
        cc::Build::new()
            .cpp(true)
            .std("c++17")
            .file("src/backends/gloo/shim.cc")
            .warnings(false)
            .compile("chorus_gloo_shim");
        println!("cargo:rustc-link-lib=dylib=gloo");
        println!("cargo:rustc-link-lib=dylib=stdc++");
    }
}
