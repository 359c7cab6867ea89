//! Compiles the `grpc` backend's .proto with protox (pure Rust), so that no system protoc is
//! needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/tasks.proto");
    let fds = protox::compile(["proto/tasks.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .bytes(".")
        .compile_fds(fds)?;
    Ok(())
}
