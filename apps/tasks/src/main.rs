//! `tasks`: serve the Tasks API, run a backend alone, or fill the database.
//!
//! ```sh
//! cargo run --release -p coherent-tasks -- serve            # SQLite file tasks.db, coherent;
//!                                                          # the live page at http://127.0.0.1:8080/
//! DATABASE_URL=postgres://... cargo run --release -p coherent-tasks -- seed --tasks 10000
//! cargo run -p coherent-tasks -- typescript --out apps/tasks/web/src/generated/tasks.ts
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use coherent_tasks::app::{self, DbConfig, LiveBackend};
use coherent_tasks::web;
use tokio::net::TcpListener;

#[derive(Parser)]
#[command(
    name = "tasks",
    about = "The Tasks API, served directly, through gRPC or through Coherent"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
    /// PostgreSQL to use instead of the SQLite file (empty: none).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// The PostgreSQL schema of the tables.
    #[arg(long, default_value = "public", global = true)]
    schema: String,
    /// The SQLite file, when no PostgreSQL URL is given.
    #[arg(long, default_value = "tasks.db", global = true)]
    sqlite: PathBuf,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serves the HTTP API (`/api`). With the `coherent` backend started in this process
    /// (no `--connect`), also the live page (`/`), the backend's RPC endpoint over
    /// WebSocket (`/rpc`) and its compute methods as JSON (`/gateway`); with `--connect`
    /// the backends are elsewhere and so is their endpoint: only `/api` (run `backend
    /// --http` for the rest).
    Serve {
        /// Where HTTP listens.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// What answers the requests.
        #[arg(long, value_enum, default_value_t = Kind::Coherent)]
        backend: Kind,
        /// Backends to connect to (`coherent`: one or more, failing over; `grpc`: one;
        /// none: start one in this process, on loopback).
        #[arg(long)]
        connect: Vec<SocketAddr>,
        /// The live page's files, a build of `apps/tasks/web` [default:
        /// apps/tasks/web/dist, else the one beside this crate's sources].
        #[arg(long, env = "TASKS_WEB")]
        web: Option<PathBuf>,
        /// Seed this many tasks (in 20 projects) first, if the database has no project yet:
        /// a demo in one command.
        #[arg(long, value_name = "TASKS")]
        seed: Option<usize>,
        /// Serve the process's counters at `http://ADDR/metrics`, in Prometheus' text
        /// format: an address of its own, for the operator's network.
        #[arg(long, value_name = "ADDR")]
        metrics: Option<SocketAddr>,
        #[command(flatten)]
        auth: AuthArgs,
        #[command(flatten)]
        limits: LimitArgs,
        #[command(flatten)]
        tier: TierArgs,
    },
    /// Runs a Coherent backend alone (HTTP tiers connect to it with `serve --connect`).
    Backend {
        /// Where its RPC endpoint listens (TCP).
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: SocketAddr,
        /// Also serve HTTP here: the live page (`/`), the API (`/api`, a tier of this
        /// backend), the endpoint over WebSocket (`/rpc`) and the compute methods as JSON
        /// (`/gateway`).
        #[arg(long)]
        http: Option<SocketAddr>,
        /// The live page's files, as for `serve`.
        #[arg(long, env = "TASKS_WEB")]
        web: Option<PathBuf>,
        /// Serve the process's counters at `http://ADDR/metrics`, as for `serve`.
        #[arg(long, value_name = "ADDR")]
        metrics: Option<SocketAddr>,
        #[command(flatten)]
        auth: AuthArgs,
        #[command(flatten)]
        limits: LimitArgs,
        #[command(flatten)]
        tier: TierArgs,
    },
    /// Runs the `grpc` backend's gRPC service alone (HTTP tiers connect to it with
    /// `serve --backend grpc --connect`).
    GrpcBackend {
        /// Where the gRPC service listens.
        #[arg(long, default_value = "127.0.0.1:7071")]
        listen: SocketAddr,
    },
    /// Fills the database with projects and tasks.
    Seed {
        /// How many tasks.
        #[arg(long, default_value_t = 10_000)]
        tasks: usize,
        /// How many projects they are spread over.
        #[arg(long, default_value_t = 20)]
        projects: usize,
    },
    /// Prints the OpenAPI document.
    Openapi,
    /// Prints the TypeScript declarations of the compute service's methods and types (what
    /// the TypeScript client calls over MessagePack), or writes them to a file.
    Typescript {
        /// The file to write (`apps/tasks/web/src/generated/tasks.ts` is the checked-in one);
        /// standard output when absent.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// Who may do what over HTTP (see `coherent_tasks::session`).
#[derive(clap::Args)]
struct AuthArgs {
    /// Logins: `on` (writes need one; reads too with `--anonymous-reads false`) or `off`
    /// (anyone may do anything: for a machine of one's own).
    #[arg(long, value_enum, default_value_t = AuthMode::On)]
    auth: AuthMode,
    /// A user, as `NAME:PASSWORD` (repeat it, or give `TASKS_USERS` as a comma-separated
    /// list). None: a user `admin` with a password made up now and printed.
    #[arg(
        long = "user",
        value_name = "NAME:PASSWORD",
        env = "TASKS_USERS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    users: Vec<String>,
    /// A file of users, one `NAME:PASSWORD` a line, taken as it is (blank lines and lines
    /// starting with `#` skipped), with those of `--user`: a password on the command line
    /// is shown to every user of the machine by `ps`. Refused if every user may write it.
    #[arg(long, value_name = "PATH", env = "TASKS_USERS_FILE")]
    users_file: Option<PathBuf>,
    /// The secret logins are signed with (16 bytes or more), the same for every process of
    /// a deployment. None: one made up now (logins end when the process does).
    #[arg(long, env = "TASKS_SESSION_SECRET", hide_env_values = true)]
    session_secret: Option<String>,
    /// A file holding the secret of `--session-secret` (a final line break not counted).
    #[arg(
        long,
        value_name = "PATH",
        env = "TASKS_SESSION_SECRET_FILE",
        conflicts_with = "session_secret"
    )]
    session_secret_file: Option<PathBuf>,
    /// Whether clients that did not log in may read (the API's GETs, `/rpc`, `/gateway`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    anonymous_reads: bool,
    /// Send the login cookie only over HTTPS (behind a TLS proxy).
    #[arg(long)]
    secure_cookie: bool,
}

/// What one client address may take of the HTTP server (see `coherent_tasks::app::HttpLimits`).
#[derive(clap::Args)]
struct LimitArgs {
    /// Requests (and calls over `/rpc`) one address may send per second, twice as many at
    /// once; past it they wait, and past a second's wait are answered 429. 0: no limit.
    #[arg(long, default_value_t = 100)]
    requests_per_ip: u32,
    /// Writes (any method but `GET`, `HEAD`, `OPTIONS`) one address may send per second, within
    /// `--requests-per-ip`, twice as many at once. 0: no limit of their own.
    #[arg(long, default_value_t = 20)]
    writes_per_ip: u32,
    /// Connections one address may hold at once (at least 1).
    #[arg(long, default_value_t = 256)]
    max_connections_per_ip: usize,
    /// Calls each browser connection over `/rpc` may start per second, twice as many at
    /// once (its address's rate applies as well). 0: no limit of its own.
    #[arg(long, default_value_t = 100)]
    rpc_calls_per_connection: u32,
    /// A web page (an origin, as in `https://tasks.example.com`, or an app's, as in
    /// `tauri://localhost`) besides the server's own that may open `/rpc`: behind a proxy
    /// that rewrites `Host`, the public origin. The scheme's default port may be written
    /// or not. Repeat it for more; `*` for any (not on the open internet).
    #[arg(
        long = "allowed-origin",
        value_name = "ORIGIN",
        value_delimiter = ',',
        value_parser = origin
    )]
    allowed_origins: Vec<String>,
    /// Gateway event feeds (`/gateway/.../events`) open at once, each holding a connection.
    #[arg(long, default_value_t = app::MAX_SSE_FEEDS)]
    max_sse_feeds: usize,
    /// Peers held to neither per-address limit: monitors, or a reverse proxy that limits per
    /// client itself (else name it with `--trusted-proxy`). Never applied to an address a
    /// proxy's `X-Forwarded-For` names. Giving it replaces the default.
    #[arg(
        long = "exempt-ip",
        value_name = "ADDR",
        value_delimiter = ',',
        default_values_t = [
            std::net::IpAddr::from([127, 0, 0, 1]),
            std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        ]
    )]
    exempt_ips: Vec<std::net::IpAddr>,
    /// Reverse proxies in front of this server whose `X-Forwarded-For` is believed: their
    /// requests are held to the per-address limits of the client the header names (the
    /// rightmost entry that is not one of these proxies), and their connections to none.
    /// None by default: the header is ignored.
    #[arg(long = "trusted-proxy", value_name = "ADDR", value_delimiter = ',')]
    trusted_proxies: Vec<std::net::IpAddr>,
    /// How many addresses' worth of the per-address limits the /64s of one IPv6 network of
    /// `--network-prefix` bits get in all (0: no such limit).
    #[arg(long, default_value_t = 8)]
    network_share: u32,
    /// The length of the IPv6 prefix whose /64s share `--network-share`: one customer's
    /// allocation (a /56 for a home or a cloud network, a /48 for a site). At most 63.
    #[arg(long, default_value_t = 56, value_parser = clap::value_parser!(u8).range(1..=63))]
    network_prefix: u8,
    /// Seconds a request over its address's rate may be held back before it is served;
    /// past it, 429.
    #[arg(long, value_name = "SECONDS", default_value_t = 1.0)]
    max_pace_wait: f64,
    /// Seconds a write to a client that reads nothing may wait for room before its
    /// connection (a WebSocket too) is closed.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    write_stall_timeout: f64,
}

impl LimitArgs {
    /// What a browser's connections to the backend's endpoint may do.
    fn backend_options(&self) -> app::BackendOptions {
        app::BackendOptions {
            untrusted_call_rate: (self.rpc_calls_per_connection > 0)
                .then(|| coherent::rpc::pace::Rate::per_second(self.rpc_calls_per_connection)),
            allowed_origins: self.allowed_origins.clone(),
            max_sse_feeds: self.max_sse_feeds,
            // Set by the commands that take `--tier-token-file`.
            tier_token: None,
        }
    }

    fn build(self) -> anyhow::Result<app::HttpLimits> {
        Ok(app::HttpLimits {
            requests_per_ip: (self.requests_per_ip > 0)
                .then(|| coherent::rpc::pace::Rate::per_second(self.requests_per_ip)),
            writes_per_ip: (self.writes_per_ip > 0)
                .then(|| coherent::rpc::pace::Rate::per_second(self.writes_per_ip)),
            max_connections_per_ip: self.max_connections_per_ip,
            exempt_ips: self.exempt_ips,
            trusted_proxies: self.trusted_proxies,
            network_share: self.network_share,
            network_prefix: self.network_prefix,
            max_pace_wait: seconds(self.max_pace_wait, "--max-pace-wait")?,
            write_stall_timeout: match seconds(self.write_stall_timeout, "--write-stall-timeout")? {
                d if d.is_zero() => anyhow::bail!(
                    "--write-stall-timeout 0 would close a connection at its first full socket"
                ),
                d => d,
            },
            ..app::HttpLimits::default()
        })
    }
}

/// An origin as a browser sends it (`https://tasks.example.com`, `http://localhost:5173`),
/// or `*`; not `null` (every sandboxed frame and local file sends that) nor anything with a
/// path, which no browser's `Origin` matches.
fn origin(value: &str) -> Result<String, String> {
    const FORM: &str = "an origin is SCHEME://HOST[:PORT] (https://tasks.example.com, \
                        tauri://localhost), with no path; or * for any";
    let value = value.trim();
    if value == "*" {
        return Ok(value.to_owned());
    }
    let (scheme, rest) = value.split_once("://").ok_or(FORM)?;
    // RFC 3986: a letter, then letters, digits, `+`, `-` and `.`.
    let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !scheme_ok {
        return Err(FORM.to_owned());
    }
    // Pages of these schemes have an opaque origin: a browser sends `null` for them, which
    // no entry may allow.
    if ["file", "data", "javascript", "blob", "about"]
        .iter()
        .any(|s| scheme.eq_ignore_ascii_case(s))
    {
        return Err(format!(
            "a {scheme}: page has no origin to allow (browsers send `null` for it)"
        ));
    }
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    // A bracketed IPv6 address may hold colons; a port comes after the last one outside it.
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !p.contains(']') => (h, Some(p)),
        _ => (authority, None),
    };
    let bracketed = host.starts_with('[') && host.ends_with(']');
    let host_ok = !host.is_empty()
        && host.is_ascii()
        && !host.contains(['/', '?', '#', '@', ' ', '\t'])
        && (bracketed || !host.contains([':', '[', ']']));
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0));
    if !host_ok || !port_ok {
        return Err(format!(
            "{FORM} (an international host in its ASCII form, xn--...)"
        ));
    }
    Ok(value.to_owned())
}

/// `value` seconds as a duration, or an error naming `flag`.
fn seconds(value: f64, flag: &str) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(value)
        .map_err(|e| anyhow::anyhow!("{flag} {value}: not a number of seconds ({e})"))
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum AuthMode {
    On,
    Off,
}

impl AuthArgs {
    /// The logins, or `None` with `--auth off`.
    fn build(self) -> anyhow::Result<Option<coherent_tasks::session::Auth>> {
        use coherent_tasks::session::{Auth, AuthConfig};
        if self.auth == AuthMode::Off {
            eprintln!("tasks: --auth off: anyone who reaches this server may read and write");
            return Ok(None);
        }
        for flag in ["--user", "--session-secret"] {
            if on_command_line(flag) {
                eprintln!(
                    "tasks: warning: {flag} on the command line is shown to every user of this \
                     machine (ps, /proc): give it in a file (--users-file, \
                     --session-secret-file) or the environment (TASKS_USERS, \
                     TASKS_SESSION_SECRET)"
                );
            }
        }
        let secret = match (self.session_secret, &self.session_secret_file) {
            (Some(s), _) => s.into_bytes(),
            (None, Some(path)) => {
                let mut secret = secret_file(path, "--session-secret-file")?;
                for end in [b'\n', b'\r'] {
                    if secret.last() == Some(&end) {
                        secret.pop();
                    }
                }
                secret
            }
            (None, None) => made_up(32).into_bytes(),
        };
        let mut users = self.users;
        if let Some(path) = &self.users_file {
            let text = String::from_utf8(secret_file(path, "--users-file")?)
                .map_err(|_| anyhow::anyhow!("--users-file {}: not UTF-8", path.display()))?;
            // Lines as they are (a password may begin or end with a space), but for the
            // carriage return of a file written on Windows.
            let before = users.len();
            users.extend(
                text.lines()
                    .map(|l| l.strip_suffix('\r').unwrap_or(l))
                    .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
                    .map(str::to_owned),
            );
            if users.len() == before {
                // Not a made-up admin instead: a file that failed to mount would print its
                // password to the log.
                anyhow::bail!("--users-file {}: no users in it", path.display());
            }
        }
        let mut config = AuthConfig::new(secret);
        config.anonymous_reads = self.anonymous_reads;
        config.secure_cookie = self.secure_cookie;
        if users.is_empty() {
            let password = made_up(16);
            eprintln!(
                "tasks: log in as admin with password {password} (or give --user NAME:PASSWORD)"
            );
            config = config.user("admin", password);
        }
        for user in users {
            let (name, password) = user.split_once(':').ok_or_else(|| {
                // Not the line itself: it may be a password.
                anyhow::anyhow!("a user given without a ':' (each is NAME:PASSWORD)")
            })?;
            config = config.user(name, password);
        }
        Ok(Some(Auth::new(config)?))
    }
}

/// The token a Coherent backend asks of its tiers, and its tiers present.
#[derive(clap::Args, Debug, Clone)]
struct TierArgs {
    /// A file holding the token the HTTP tiers present to the Coherent backend (its first
    /// line): `backend` refuses a TCP connection without it (every one it accepts is
    /// trusted as a tier), `serve --connect` presents it. The same file on both.
    #[arg(long, env = "TASKS_TIER_TOKEN_FILE", value_name = "PATH")]
    tier_token_file: Option<PathBuf>,
}

impl TierArgs {
    fn token(&self) -> anyhow::Result<Option<String>> {
        let Some(path) = &self.tier_token_file else {
            return Ok(None);
        };
        let text = String::from_utf8(secret_file(path, "--tier-token-file")?)
            .map_err(|_| anyhow::anyhow!("--tier-token-file {}: not UTF-8", path.display()))?;
        // Spaces around it are not part of it: two copies of the file that differ only
        // there still agree.
        let token = text.lines().next().unwrap_or("").trim();
        if token.len() < 16 {
            anyhow::bail!(
                "--tier-token-file {}: the token (its first line) must be 16 bytes or more",
                path.display()
            );
        }
        if token.len() > coherent::rpc::handshake::MAX_TOKEN_LEN {
            anyhow::bail!(
                "--tier-token-file {}: the token is over {} bytes",
                path.display(),
                coherent::rpc::handshake::MAX_TOKEN_LEN
            );
        }
        Ok(Some(token.to_owned()))
    }
}

/// Whether `flag` was given as an argument (not through the environment).
fn on_command_line(flag: &str) -> bool {
    std::env::args_os().skip(1).any(|a| {
        a.to_str().is_some_and(|a| {
            a == flag
                || a.strip_prefix(flag)
                    .is_some_and(|rest| rest.starts_with('='))
        })
    })
}

/// The bytes of a file holding secrets: a plain file of at most [`MAX_SECRET_FILE`]
/// bytes, that not every user of the machine may write (refused) or read (a warning).
fn secret_file(path: &std::path::Path, flag: &str) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context as _;
    use std::io::Read as _;
    let named = || format!("{flag} {}", path.display());
    let file = std::fs::File::open(path).with_context(named)?;
    let meta = file.metadata().with_context(named)?;
    if !meta.is_file() {
        anyhow::bail!("{}: not a plain file", named());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = meta.permissions().mode();
        if mode & 0o002 != 0 {
            anyhow::bail!(
                "{}: every user of this machine may write it (chmod o-w)",
                named()
            );
        }
        if mode & 0o004 != 0 {
            eprintln!(
                "tasks: warning: {}: every user of this machine may read it (chmod o-r)",
                named()
            );
        }
    }
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_FILE + 1)
        .read_to_end(&mut bytes)
        .with_context(named)?;
    if bytes.len() as u64 > MAX_SECRET_FILE {
        anyhow::bail!("{}: larger than {MAX_SECRET_FILE} bytes", named());
    }
    Ok(bytes)
}

/// The largest file of users or of the session secret read.
const MAX_SECRET_FILE: u64 = 1 << 20;

/// `router` behind `auth`'s rules, or as it is without.
fn protect(auth: Option<&coherent_tasks::session::Auth>, router: axum::Router) -> axum::Router {
    match auth {
        Some(auth) => auth.protect(router),
        None => router,
    }
}

/// `n` random letters and digits.
fn made_up(n: usize) -> String {
    use rand::distr::{Alphanumeric, SampleString};
    Alphanumeric.sample_string(&mut rand::rng(), n)
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    /// A query per request.
    Direct,
    /// A gRPC service over loopback that queries the database.
    Grpc,
    /// Replicas of a Coherent backend; writes as commands.
    Coherent,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // What the backends and the operation host log (a notifier reconnecting, a slow
    // client cut off, a failed request): `RUST_LOG` picks the level, `info` by default.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let db = match cli.database_url.filter(|u| !u.is_empty()) {
        Some(url) => DbConfig::Postgres {
            url,
            schema: cli.schema,
        },
        None => DbConfig::Sqlite(cli.sqlite),
    };
    match cli.command {
        Cmd::Serve {
            listen,
            backend,
            connect,
            web,
            seed,
            metrics,
            auth,
            limits,
            tier,
        } => {
            let auth = auth.build()?;
            let mut options = limits.backend_options();
            let limits = limits.build()?;
            let tier_token = tier.token()?;
            if tier_token.is_some() && !matches!(backend, Kind::Coherent) {
                anyhow::bail!("--tier-token-file is for the coherent backend's tiers");
            }
            if let Some(tasks) = seed {
                let store = db.open(2).await?;
                if store.projects().await?.is_empty() {
                    let ids = app::seed(&store, 20, tasks).await?;
                    eprintln!("tasks: seeded {tasks} tasks in {} projects", ids.len());
                }
            }
            // A backend started here serves as long as this process.
            let mut in_process = None;
            let router = match backend {
                Kind::Direct => app::direct_router(&db).await?,
                Kind::Grpc => {
                    let addr = match connect.as_slice() {
                        [] => {
                            let listener = TcpListener::bind("127.0.0.1:0").await?;
                            // It serves as long as this process (dropping the handle
                            // leaves the task running).
                            let (addr, _serving) = app::start_grpc_backend(&db, listener).await?;
                            addr
                        }
                        [addr] => *addr,
                        _ => anyhow::bail!("the grpc backend connects to one address"),
                    };
                    app::grpc_router(addr).await?
                }
                Kind::Coherent if connect.is_empty() => {
                    // Its tier is in this process: the backend's TCP port, on loopback, is
                    // for nobody (a token no one knows, if none was given).
                    options.tier_token = Some(tier_token.unwrap_or_else(|| made_up(32)));
                    let listener = TcpListener::bind("127.0.0.1:0").await?;
                    let b =
                        LiveBackend::start_with_options(&db, listener, None, auth.clone(), options)
                            .await?;
                    let router = b.http_router(web::dir(web)).await?;
                    in_process = Some(b);
                    router
                }
                Kind::Coherent => app::live_router_with(&connect, tier_token).await?,
            };
            let listener = TcpListener::bind(listen).await?;
            let addr = listener.local_addr()?;
            if in_process.is_some() {
                eprintln!(
                    "tasks: serving http://{addr}/ (the live page), /api/tasks, /rpc and /gateway"
                );
            } else {
                eprintln!("tasks: serving http://{addr}/api/tasks");
            }
            let stats = Arc::new(app::HttpStats::default());
            if let Some(at) = metrics {
                let observer = in_process
                    .as_ref()
                    .map_or_else(coherent::metrics::Observer::new, LiveBackend::observer);
                serve_metrics(at, app::Metrics::new(observer, [("api", stats.clone())])).await?;
            }
            app::serve_http_counted(listener, protect(auth.as_ref(), router), limits, stats).await
        }
        Cmd::Backend {
            listen,
            http,
            web,
            metrics,
            auth,
            limits,
            tier,
        } => {
            let auth = auth.build()?;
            let mut options = limits.backend_options();
            let limits = limits.build()?;
            options.tier_token = tier.token()?;
            if !listen.ip().is_loopback() {
                // Its TCP connections are trusted (the tiers): every write waits for them,
                // and they run commands without a login.
                if options.tier_token.is_none() {
                    eprintln!(
                        "tasks: warning: the backend's RPC port {listen} trusts whoever \
                         connects (it is for the HTTP tiers): give it --tier-token-file, and \
                         keep it on a private network"
                    );
                } else {
                    eprintln!(
                        "tasks: note: the tiers' token travels unencrypted to {listen}, and \
                         connections without it hold places until refused: keep the port on \
                         a private network"
                    );
                }
            }
            let listener = TcpListener::bind(listen).await?;
            let b =
                LiveBackend::start_with_options(&db, listener, None, auth.clone(), options).await?;
            eprintln!("tasks: Coherent backend on {}", b.addr);
            let stats = Arc::new(app::HttpStats::default());
            if let Some(at) = metrics {
                let http_stats = http.map(|_| ("api", stats.clone()));
                serve_metrics(at, app::Metrics::new(b.observer(), http_stats)).await?;
            }
            if let Some(http) = http {
                let listener = TcpListener::bind(http).await?;
                eprintln!(
                    "tasks: serving http://{}/ (the live page), /api, /rpc and /gateway",
                    listener.local_addr()?
                );
                let router = protect(auth.as_ref(), b.http_router(web::dir(web)).await?);
                tokio::spawn(async move {
                    if let Err(e) = app::serve_http_counted(listener, router, limits, stats).await {
                        tracing::error!(error = %format!("{e:#}"), "the backend's HTTP stopped");
                    }
                });
            }
            tokio::signal::ctrl_c().await?;
            b.stop().await;
            Ok(())
        }
        Cmd::GrpcBackend { listen } => {
            let listener = TcpListener::bind(listen).await?;
            let store = db.open(app::POOL_SIZE).await?;
            eprintln!("tasks: gRPC backend on {}", listener.local_addr()?);
            tokio::select! {
                r = tokio::signal::ctrl_c() => Ok(r?),
                r = coherent_tasks::grpc::serve_grpc(store, listener) => r,
            }
        }
        Cmd::Seed { tasks, projects } => {
            let store = db.open(4).await?;
            let ids = app::seed(&store, projects, tasks).await?;
            eprintln!("tasks: {tasks} tasks in {} projects", ids.len());
            Ok(())
        }
        Cmd::Openapi => {
            println!("{}", coherent_tasks::openapi::document());
            Ok(())
        }
        Cmd::Typescript { out } => {
            let ts = coherent_tasks::typescript::declarations();
            match out {
                Some(path) => {
                    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                        std::fs::create_dir_all(dir)?;
                    }
                    std::fs::write(&path, ts)?;
                    eprintln!("tasks: wrote {}", path.display());
                }
                None => print!("{ts}"),
            }
            Ok(())
        }
    }
}

/// Serves `metrics` at `http://at/metrics` on a task of its own, with limits sized for a
/// few scrapers (its connections are not the API's, so they are bounded on their own).
async fn serve_metrics(at: SocketAddr, metrics: app::Metrics) -> anyhow::Result<()> {
    let listener = TcpListener::bind(at).await?;
    eprintln!(
        "tasks: metrics at http://{}/metrics",
        listener.local_addr()?
    );
    if !at.ip().is_loopback() {
        eprintln!(
            "tasks: warning: the metrics on {at} answer whoever connects (they tell how the \
             server is doing): keep them on a private network"
        );
    }
    tokio::spawn(async move {
        let limits = app::HttpLimits {
            max_connections: 32,
            max_connections_per_ip: 8,
            ..Default::default()
        };
        if let Err(e) = app::serve_http_with(listener, metrics.router(), limits).await {
            tracing::error!(error = %format!("{e:#}"), "the metrics server stopped");
        }
    });
    Ok(())
}
