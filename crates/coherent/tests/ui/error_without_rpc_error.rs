// The error type cannot report a lost connection, so the stub could not implement the trait.
// (An error type of its own: what implements `From` for `String` depends on which crates
// are linked, and would change this output with the features a build has.)
use coherent::prelude::*;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Failed(pub String);

#[compute_service]
pub trait Users {
    async fn name(&self, id: u64) -> Result<String, Failed>;
}

fn main() {}
