// No variant says what an RPC failure becomes.
#[derive(Debug, coherent::FromRpcError)]
enum UsersError {
    Database(String),
    Unavailable(String),
}

// Two fields: which would hold the error?
#[derive(Debug, coherent::FromRpcError)]
enum TwoFields {
    #[rpc_error]
    Unavailable(String, u32),
}

fn main() {}
