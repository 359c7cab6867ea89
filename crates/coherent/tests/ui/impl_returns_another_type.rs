// The server's implementation answers with a type other than the trait's.
use coherent::prelude::*;

#[compute_service]
pub trait Users {
    async fn name(&self, id: u64) -> Result<String, RpcError>;
}

#[derive(Clone, ComputeService)]
struct Db {
    handle: ServiceHandle,
}

#[compute_service]
impl Users for Db {
    async fn name(&self, id: u64) -> Result<u64, RpcError> {
        Ok(id)
    }
}

fn main() {}
