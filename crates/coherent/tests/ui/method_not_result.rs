// A method that cannot fail cannot be called over a connection that can.
use coherent::prelude::*;

#[compute_service]
pub trait Users {
    async fn name(&self, id: u64) -> String;
}

fn main() {}
