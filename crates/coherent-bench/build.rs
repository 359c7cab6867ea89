//! Compiles the rpc suite's .proto for the tonic peer with protox (pure Rust), so that no
//! system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/rpc_bench.proto");
    let fds = protox::compile(["proto/rpc_bench.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .bytes(".")
        .compile_fds(fds)?;
    Ok(())
}
