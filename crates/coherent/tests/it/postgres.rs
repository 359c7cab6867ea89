//! The same service over PostgreSQL. Runs when `DATABASE_URL` is set (CI sets it); prints that
//! it skipped otherwise. A set but unreachable `DATABASE_URL` fails the test.

use std::sync::Arc;

use coherent::{compute_service, ComputeService, Registry, ServiceHandle};
use tokio_postgres::{Client, NoTls};

use crate::support::Log;

async fn connect() -> Option<Client> {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("skipped: DATABASE_URL is not set");
        return None;
    };
    let (client, connection) = tokio_postgres::connect(&url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("DATABASE_URL is set but PostgreSQL is unreachable: {e}"));
    tokio::spawn(connection);
    Some(client)
}

#[derive(Clone, ComputeService)]
struct Stock {
    handle: ServiceHandle,
    db: Arc<Client>,
    table: Arc<str>,
    log: Log,
}

#[compute_service]
impl Stock {
    #[compute]
    async fn quantity(&self, sku: String) -> Result<i64, Arc<str>> {
        self.log.push(format!("quantity({sku})"));
        let query = format!("SELECT quantity FROM {} WHERE sku = $1", self.table);
        let row = self
            .db
            .query_opt(&query, &[&sku])
            .await
            .map_err(|e| Arc::<str>::from(e.to_string()))?;
        Ok(row.map_or(0, |r| r.get(0)))
    }

    #[compute]
    async fn in_stock(&self, sku: String) -> Result<bool, Arc<str>> {
        self.log.push(format!("in_stock({sku})"));
        Ok(self.quantity(sku).await? > 0)
    }
}

impl Stock {
    async fn set(&self, sku: &str, quantity: i64) {
        let statement = format!(
            "INSERT INTO {} (sku, quantity) VALUES ($1, $2)
             ON CONFLICT (sku) DO UPDATE SET quantity = EXCLUDED.quantity",
            self.table
        );
        self.db
            .execute(&statement, &[&sku, &quantity])
            .await
            .unwrap();
        self.invalidate_quantity(sku.to_owned());
    }
}

#[tokio::test]
async fn postgres_rows_are_cached_and_refreshed_after_a_write_through_the_service() {
    let Some(client) = connect().await else {
        return;
    };
    let table = format!("coherent_stock_{}", std::process::id());
    client
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {table};
             CREATE TABLE {table} (sku TEXT PRIMARY KEY, quantity BIGINT NOT NULL);"
        ))
        .await
        .unwrap();
    let log = Log::default();
    let stock = Stock {
        handle: ServiceHandle::with_registry(&Registry::new()),
        db: Arc::new(client),
        table: table.clone().into(),
        log: log.clone(),
    };

    assert!(!stock.in_stock("apple".into()).await.unwrap());
    assert!(!stock.in_stock("apple".into()).await.unwrap());
    assert_eq!(log.take_sorted(), ["in_stock(apple)", "quantity(apple)"]);

    stock.set("apple", 3).await;
    assert!(stock.in_stock("apple".into()).await.unwrap());
    assert_eq!(stock.quantity("apple".into()).await.unwrap(), 3);
    assert_eq!(log.take_sorted(), ["in_stock(apple)", "quantity(apple)"]);

    stock
        .db
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}
