//! The `tasks` binary's secrets: users and the session secret from files (a password on
//! the command line is shown to every user of the machine by `ps`), and the warning when
//! one is given there anyway.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

/// A `tasks serve` process, killed when dropped (a failed assertion leaves none behind).
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `tasks serve` with `args` on the SQLite file `tasks.db` in `dir`, on a loopback port,
/// with none of the environment's settings, its stderr piped.
fn tasks_serve(dir: &std::path::Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tasks"));
    command
        .arg("--sqlite")
        .arg(dir.join("tasks.db"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("TASKS_USERS")
        .env_remove("TASKS_SESSION_SECRET")
        .env_remove("TASKS_USERS_FILE")
        .env_remove("TASKS_SESSION_SECRET_FILE")
        .env_remove("TASKS_TIER_TOKEN_FILE")
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

/// `tasks serve` with `args` on a fresh SQLite file in `dir`: the process, the address it
/// serves, and what it wrote to stderr before that.
fn serve(dir: &std::path::Path, args: &[&str]) -> (Served, SocketAddr, String) {
    let mut served = Served(tasks_serve(dir, args).spawn().unwrap());
    let mut stderr = BufReader::new(served.0.stderr.take().unwrap());
    let mut said = String::new();
    loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            panic!("tasks serve ended before serving: {said}");
        }
        said.push_str(&line);
        if let Some(rest) = line.strip_prefix("tasks: serving http://") {
            let addr = rest.split('/').next().unwrap().parse().unwrap();
            // Whatever it writes later is drained, so that it never blocks on a full pipe.
            std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
            return (served, addr, said);
        }
    }
}

/// `POST /api/session` with `name` and `password`: the status.
fn login(addr: SocketAddr, name: &str, password: &str) -> u16 {
    let body = format!(r#"{{"name":"{name}","password":"{password}"}}"#);
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /api/session HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer[9..12].parse().unwrap()
}

fn write_secret(path: &std::path::Path, text: &str) {
    std::fs::write(path, text).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
}

#[test]
fn users_and_the_session_secret_come_from_files() {
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users");
    write_secret(
        &users,
        "# who may write\r\nada:first-password-1\r\n\ngrace: second password 2 \n",
    );
    let secret = dir.path().join("secret");
    write_secret(&secret, "a-secret-of-more-than-sixteen-bytes\n");
    let (served, addr, said) = serve(
        dir.path(),
        &[
            "--users-file",
            users.to_str().unwrap(),
            "--session-secret-file",
            secret.to_str().unwrap(),
        ],
    );
    assert!(!said.contains("warning"), "{said}");
    // No made-up admin: the file's users.
    assert!(!said.contains("log in as admin"), "{said}");
    assert_eq!(login(addr, "ada", "first-password-1"), 200);
    // A line is taken as it is: the spaces around a password are its own.
    assert_eq!(login(addr, "grace", " second password 2 "), 200);
    assert_eq!(login(addr, "grace", "second password 2"), 401);
    assert_eq!(login(addr, "ada", " second password 2 "), 401);
    drop(served);
}

#[test]
fn a_password_on_the_command_line_is_warned_about_and_a_bad_line_not_echoed() {
    let dir = tempfile::tempdir().unwrap();
    let (served, addr, said) = serve(dir.path(), &["--user=ada:first-password-1"]);
    assert!(
        said.contains("warning: --user on the command line is shown to every user"),
        "{said}"
    );
    assert_eq!(login(addr, "ada", "first-password-1"), 200);
    drop(served);

    // Refused, each with a clear error and without printing what is in the file (it may
    // be a password): a line without a ':', a file with no users, one anyone may write.
    let users = dir.path().join("users");
    for (text, mode, said) in [
        ("ada-without-a-colon-SECRET\n", 0o600, "NAME:PASSWORD"),
        ("# SECRET\n\n", 0o600, "no users"),
        ("ada:first-password-SECRET\n", 0o602, "may write it"),
    ] {
        std::fs::write(&users, text).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&users, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let _ = mode;
        let err = refused(dir.path(), &["--users-file", users.to_str().unwrap()]);
        assert!(err.contains(said), "{err}");
        assert!(!err.contains("SECRET"), "{err}");
    }
}

/// `tasks serve` with `args`, which must end at once with an error: what it wrote. One
/// that serves instead is killed at a deadline and fails the test.
fn refused(dir: &std::path::Path, args: &[&str]) -> String {
    let mut served = Served(tasks_serve(dir, args).spawn().unwrap());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = served.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tasks serve {args:?} did not end"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(!status.success());
    let mut err = String::new();
    served
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}

/// `--allowed-origin` lets a page of that origin open `/rpc`; any other page is still
/// refused (403), and the server's own origin still allowed.
#[test]
fn an_allowed_origin_may_open_rpc_and_others_may_not() {
    let dir = tempfile::tempdir().unwrap();
    let (served, addr, _) = serve(
        dir.path(),
        &[
            "--auth",
            "off",
            "--allowed-origin",
            "https://tasks.example.com:443,tauri://localhost",
        ],
    );
    let upgrade = |origin: &str| {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        write!(
            s,
            "GET /rpc HTTP/1.1\r\nHost: {addr}\r\nOrigin: {origin}\r\nConnection: Upgrade\r\n\
             Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        .unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).unwrap();
        String::from_utf8_lossy(&head[9..12]).into_owned()
    };
    // The default port written in the flag: browsers never send it.
    assert_eq!(upgrade("https://tasks.example.com"), "101");
    assert_eq!(upgrade("tauri://localhost"), "101");
    assert_eq!(upgrade(&format!("http://{addr}")), "101");
    assert_eq!(upgrade("https://evil.example"), "403");
    drop(served);

    // What no browser sends as an origin is refused at start.
    for bad in [
        "null",
        "tasks.example.com",
        "https://tasks.example.com/app",
        "1x://a",
        "://a",
        "file://host",
        "javascript://x",
        "https://tasks.example.com:",
        "https://tasks.example.com:99999",
        "https://tasks.example.com:443:443",
        "https://täsks.example.com",
    ] {
        let err = refused(dir.path(), &["--auth", "off", "--allowed-origin", bad]);
        assert!(err.contains("origin"), "{bad}: {err}");
    }
}

/// `--tier-token-file`: a token of fewer than 16 characters, or a file anyone may write, is
/// refused at start; a good one is taken.
#[test]
fn a_tier_token_file_is_checked_at_start() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tier-token");
    let write = |text: &str, mode: u32| {
        std::fs::write(&file, text).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    let path = file.to_str().unwrap().to_owned();
    let args = ["--auth", "off", "--tier-token-file", path.as_str()];

    write("short\n", 0o600);
    let err = refused(dir.path(), &args);
    assert!(err.contains("16 bytes"), "{err}");
    write("a token long enough for the tiers\n", 0o666);
    let err = refused(dir.path(), &args);
    assert!(err.contains("may write"), "{err}");
    // For the coherent backend's tiers only.
    write("a token long enough for the tiers\n", 0o600);
    let mut direct = args.to_vec();
    direct.extend(["--backend", "direct"]);
    let err = refused(dir.path(), &direct);
    assert!(err.contains("coherent backend"), "{err}");

    write("a token long enough for the tiers\n", 0o600);
    let (served, _, _) = serve(dir.path(), &args);
    drop(served);
}
