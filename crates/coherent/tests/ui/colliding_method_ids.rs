// Two methods whose "Users.<method>" names hash to one method id (FNV-1a, 32 bits): a
// server could not tell their calls apart.
use coherent::prelude::*;

#[compute_service]
pub trait Users {
    async fn m147(&self) -> Result<u64, RpcError>;
    async fn m1378100(&self) -> Result<u64, RpcError>;
}

fn main() {}
