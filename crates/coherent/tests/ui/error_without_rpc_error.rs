// The error type cannot report a lost connection, so the stub could not implement the trait.
use coherent::prelude::*;

#[compute_service]
pub trait Users {
    async fn name(&self, id: u64) -> Result<String, String>;
}

fn main() {}
