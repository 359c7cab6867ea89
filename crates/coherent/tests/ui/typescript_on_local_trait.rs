// A `local` trait has no server, so nothing for `typescript` to describe.
use coherent::prelude::*;

#[compute_service(local, typescript)]
pub trait Users {
    async fn name(&self, id: u64) -> String;
}

fn main() {}
