// A client calls the stub with an argument of another type than the trait's.
use coherent::prelude::*;

#[compute_service]
pub trait Users {
    async fn name(&self, id: u64) -> Result<String, RpcError>;
}

async fn read(users: UsersClient) {
    let _name: Result<String, RpcError> = users.name("seven").await;
}

fn main() {}
