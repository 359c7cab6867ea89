// A client reads the stub's answer as another type than the trait's.
use coherent::prelude::*;

#[compute_service]
pub trait Users {
    async fn name(&self, id: u64) -> Result<String, RpcError>;
}

async fn read(users: UsersClient) {
    let _name: Result<u64, RpcError> = users.name(7).await;
}

fn main() {}
