//! Sockets that do not wait for tokio's reactor where the kernel is ready already: a TCP
//! connect the kernel completed at once, and the first reads and writes of a fresh socket;
//! and a TCP reader that asks not to be woken before the bytes it knows are due arrived.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use socket2::{Domain, SockRef, Socket, Type};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{lookup_host, TcpStream, ToSocketAddrs};

use crate::config::SendBuffer;

/// Connects to the first of `addr`'s addresses that answers, with `TCP_NODELAY` set (the
/// writer batches already).
///
/// Like `TcpStream::connect`, but a non-blocking connect the kernel completed at once (always
/// so on loopback, where the handshake runs inside the `connect` call) is used at once:
/// waiting for the reactor to report the socket writable costs a thread wake-up, about a
/// fifth of a fresh connection's first call on a 2-core machine.
pub(crate) async fn connect_tcp(
    addr: impl ToSocketAddrs,
    send_buffer: SendBuffer,
) -> io::Result<TcpStream> {
    let mut last = None;
    for addr in lookup_host(addr).await? {
        match connect_one(addr, send_buffer).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "the address resolved to nothing",
        )
    }))
}

/// The send buffer [`SendBuffer::Auto`] gives a connection to this host.
const LOOPBACK_SEND_BUFFER: u32 = 512 * 1024;

/// The send buffer `choice` gives a connection to `peer`, if any (else the kernel's).
fn send_buffer_for(choice: SendBuffer, peer: SocketAddr) -> Option<u32> {
    match choice {
        SendBuffer::Kernel => None,
        SendBuffer::Bytes(n) => Some(n),
        SendBuffer::Auto => peer
            .ip()
            .to_canonical()
            .is_loopback()
            .then_some(LOOPBACK_SEND_BUFFER),
    }
}

/// Sets the send buffer of an accepted connection from `peer` as `choice` says. A failure
/// leaves the kernel's (the connection works either way).
pub(crate) fn set_send_buffer(stream: &TcpStream, peer: SocketAddr, choice: SendBuffer) {
    if let Some(bytes) = send_buffer_for(choice, peer) {
        let _ = SockRef::from(stream).set_send_buffer_size(bytes as usize);
    }
}

async fn connect_one(addr: SocketAddr, send_buffer: SendBuffer) -> io::Result<TcpStream> {
    // On Linux the socket is non-blocking from `socket(2)`: two `fcntl` calls fewer on a
    // new connection's path.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM.nonblocking(), None)?;
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    if let Some(bytes) = send_buffer_for(send_buffer, addr) {
        let _ = socket.set_send_buffer_size(bytes as usize);
    }
    // Where writes cannot say `MSG_NOSIGNAL`, the socket says it (as mio's sockets do).
    #[cfg(any(
        target_os = "ios",
        target_os = "visionos",
        target_os = "macos",
        target_os = "tvos",
        target_os = "watchos",
    ))]
    socket.set_nosigpipe(true)?;
    let started = match socket.connect(&addr.into()) {
        Ok(()) => true,
        Err(e) if in_progress(&e) => false,
        Err(e) => return Err(e),
    };
    let stream = TcpStream::from_std(std::net::TcpStream::from(socket))?;
    // `peer_addr` answers once the handshake is done; until then, wait as tokio does.
    if !started && stream.peer_addr().is_err() {
        stream.writable().await?;
        if let Some(e) = stream.take_error()? {
            return Err(e);
        }
        // Writable without an error but not connected would be a kernel oddity; the
        // first read or write reports it.
    }
    Ok(stream)
}

/// Sets `TCP_NODELAY` on a listening socket where the sockets it accepts inherit it (Linux):
/// then they need no `setsockopt` each. Returns whether they do.
pub(crate) fn nodelay_inherited(listener: &tokio::net::TcpListener) -> bool {
    cfg!(any(target_os = "linux", target_os = "android"))
        && SockRef::from(listener).set_tcp_nodelay(true).is_ok()
}

fn in_progress(e: &io::Error) -> bool {
    #[cfg(unix)]
    if e.raw_os_error() == Some(libc::EINPROGRESS) {
        return true;
    }
    e.kind() == io::ErrorKind::WouldBlock
}

/// A fresh socket whose first reads and writes go straight to the kernel.
///
/// tokio learns that a newly registered socket is readable or writable only on its
/// reactor's next turn, and until then every read and write waits for it, even with the
/// `Hello` already in the receive buffer and the send buffer empty. On a machine where
/// waking a thread is costly that turn is a good part of a connection's first call. This
/// wrapper tries the non-blocking syscall itself until the kernel first answers "would
/// block"; from then on (one wasted syscall per direction and connection) tokio's readiness
/// tracking takes over as usual.
pub(crate) struct Eager<S> {
    inner: S,
    read_direct: bool,
    write_direct: bool,
    /// What the connection's reader knows is due, where the socket can use it.
    due: Option<Due>,
    /// The receive low-water mark set on the socket; 0 for the kernel's default (1 byte).
    mark: u32,
}

impl<S: Direct> Eager<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            read_direct: true,
            write_direct: true,
            due: S::HONORS_RCVLOWAT.then(Due::default),
            mark: 0,
        }
    }

    /// The handle through which the connection's reader says how many bytes are due, where
    /// the socket can use it (TCP on Linux). Pass it only to the reader that reads this
    /// socket's bytes as they are: under TLS, say, ciphertext is buffered beneath the
    /// reader, and a mark counted in plaintext could hold back bytes already received.
    pub(crate) fn due(&self) -> Option<Due> {
        self.due.clone()
    }

    /// Sets the socket's receive low-water mark to what the reader asks, if that changed.
    fn follow_due(&mut self) -> io::Result<()> {
        let Some(due) = &self.due else { return Ok(()) };
        let want = due.0.load(Ordering::Relaxed);
        if want != self.mark {
            set_recv_low_mark(&self.inner.sock(), want.max(1))?;
            self.mark = want;
        }
        Ok(())
    }
}

/// How many bytes a connection's reader knows will arrive (the rest of a large frame), shared
/// with the socket it reads: the socket then asks the kernel not to wake the reader until that
/// many are queued (`SO_RCVLOWAT`), instead of at every segment: a 10 MiB echo took 18 reads
/// per round trip instead of 37 (`strace -c` on `examples/payload`), and fewer wake-ups of
/// the reading thread. 0 (the default) asks nothing.
///
/// The reader must never say more than the other side is bound to send (the rest of a frame
/// it has started), or it could sleep on bytes that never come; and must say 0 when it wants
/// to hear about every byte again (a keep-alive check, say): setting a lower mark wakes it at
/// once if enough bytes are queued.
#[derive(Clone, Default)]
pub(crate) struct Due(Arc<AtomicU32>);

impl Due {
    pub(crate) fn set(&self, bytes: u32) {
        self.0.store(bytes, Ordering::Relaxed);
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn set_recv_low_mark(sock: &Socket, bytes: u32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let value = bytes.min(i32::MAX as u32) as libc::c_int;
    // SAFETY: the descriptor is this live socket's, and the option value is a `c_int`
    // passed with its own size, as `setsockopt(SO_RCVLOWAT)` takes it.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn set_recv_low_mark(_: &Socket, _: u32) -> io::Result<()> {
    Ok(())
}

/// Flags of a direct send: a write to a connection the other side closed answers `EPIPE`
/// instead of raising `SIGPIPE`, which kills a process that does not ignore it (a library
/// loaded into a C or Python program), as tokio's own writes do.
#[cfg(any(
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd",
    target_os = "netbsd",
    target_os = "openbsd",
    target_os = "dragonfly",
))]
const SEND_FLAGS: i32 = libc::MSG_NOSIGNAL;
#[cfg(not(any(
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd",
    target_os = "netbsd",
    target_os = "openbsd",
    target_os = "dragonfly",
)))]
const SEND_FLAGS: i32 = 0;

/// A socket the kernel can be asked directly.
pub(crate) trait Direct {
    fn sock(&self) -> SockRef<'_>;

    /// Whether its kernel keeps a reader asleep until `SO_RCVLOWAT` bytes are queued (TCP
    /// on Linux: it checks the mark both when it wakes a reader and when `epoll` asks).
    const HONORS_RCVLOWAT: bool = false;
}

impl Direct for TcpStream {
    fn sock(&self) -> SockRef<'_> {
        SockRef::from(self)
    }

    const HONORS_RCVLOWAT: bool = cfg!(any(target_os = "linux", target_os = "android"));
}

#[cfg(unix)]
impl Direct for tokio::net::UnixStream {
    fn sock(&self) -> SockRef<'_> {
        SockRef::from(self)
    }
}

/// A socket that splits into a read half and a write half with no lock between them.
/// `tokio::io::split`, which any other transport goes through, takes a mutex at every read
/// and every write: with the reader and the writer on different threads, streaming 100-byte
/// items, its futex calls were two fifths of a connection's.
pub(crate) trait Splits: Sized {
    type Read: AsyncRead + Direct + Unpin + Send + 'static;
    type Write: AsyncWrite + Direct + Unpin + Send + 'static;

    fn into_halves(self) -> (Self::Read, Self::Write);
}

/// `socket` as two halves that go straight to the kernel while it is ready (see [`Eager`]),
/// and the read half's [`Due`], where its kernel honors one.
pub(crate) fn eager_halves<S: Splits>(socket: S) -> (Eager<S::Read>, Eager<S::Write>, Option<Due>) {
    let (rd, wr) = socket.into_halves();
    let rd = Eager::new(rd);
    let due = rd.due();
    (rd, Eager::new(wr), due)
}

impl Splits for TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;

    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

impl Direct for tokio::net::tcp::OwnedReadHalf {
    fn sock(&self) -> SockRef<'_> {
        SockRef::from(AsRef::<TcpStream>::as_ref(self))
    }

    const HONORS_RCVLOWAT: bool = TcpStream::HONORS_RCVLOWAT;
}

impl Direct for tokio::net::tcp::OwnedWriteHalf {
    fn sock(&self) -> SockRef<'_> {
        SockRef::from(AsRef::<TcpStream>::as_ref(self))
    }
}

#[cfg(unix)]
impl Splits for tokio::net::UnixStream {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;

    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

#[cfg(unix)]
impl Direct for tokio::net::unix::OwnedReadHalf {
    fn sock(&self) -> SockRef<'_> {
        SockRef::from(AsRef::<tokio::net::UnixStream>::as_ref(self))
    }
}

#[cfg(unix)]
impl Direct for tokio::net::unix::OwnedWriteHalf {
    fn sock(&self) -> SockRef<'_> {
        SockRef::from(AsRef::<tokio::net::UnixStream>::as_ref(self))
    }
}

/// What a direct syscall answered, or `None` to go through tokio instead: on "would block",
/// which also ends direct mode for that direction (`still_direct`), or on an interrupted
/// call.
fn direct<T>(still_direct: &mut bool, r: io::Result<T>) -> Option<io::Result<T>> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            *still_direct = false;
            None
        }
        Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
        r => Some(r),
    }
}

impl<S: AsyncRead + Direct + Unpin> AsyncRead for Eager<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.follow_due()?;
        if this.read_direct && buf.remaining() > 0 {
            // SAFETY: `recv` only writes into the slice, never de-initializes it, and
            // exactly the `n` bytes it reports are marked initialized and filled below.
            let unfilled = unsafe { buf.unfilled_mut() };
            let received = this.inner.sock().recv(unfilled);
            if let Some(r) = direct(&mut this.read_direct, received) {
                let n = r?;
                // SAFETY: the kernel wrote these `n` bytes.
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                return Poll::Ready(Ok(()));
            }
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Direct + Unpin> AsyncWrite for Eager<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.write_direct {
            let sent = this.inner.sock().send_with_flags(buf, SEND_FLAGS);
            if let Some(r) = direct(&mut this.write_direct, sent) {
                return Poll::Ready(r);
            }
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.write_direct {
            let sent = this.inner.sock().send_vectored_with_flags(bufs, SEND_FLAGS);
            if let Some(r) = direct(&mut this.write_direct, sent) {
                return Poll::Ready(r);
            }
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    #[test]
    fn the_automatic_send_buffer_is_set_for_peers_on_this_host_only() {
        let at = |a: &str| a.parse::<SocketAddr>().unwrap();
        let auto = |a: &str| send_buffer_for(SendBuffer::Auto, at(a));
        assert_eq!(auto("127.0.0.1:1"), Some(LOOPBACK_SEND_BUFFER));
        assert_eq!(auto("127.9.9.9:1"), Some(LOOPBACK_SEND_BUFFER));
        assert_eq!(auto("[::1]:1"), Some(LOOPBACK_SEND_BUFFER));
        assert_eq!(auto("[::ffff:127.0.0.1]:1"), Some(LOOPBACK_SEND_BUFFER));
        assert_eq!(auto("10.0.0.1:1"), None);
        assert_eq!(auto("[2001:db8::1]:1"), None);
        assert_eq!(send_buffer_for(SendBuffer::Kernel, at("127.0.0.1:1")), None);
        assert_eq!(
            send_buffer_for(SendBuffer::Bytes(65536), at("10.0.0.1:1")),
            Some(65536)
        );
    }

    #[tokio::test]
    async fn a_connection_to_this_host_gets_the_loopback_send_buffer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ours = connect_tcp(addr, SendBuffer::Auto).await.unwrap();
        let (theirs, peer) = listener.accept().await.unwrap();
        set_send_buffer(&theirs, peer, SendBuffer::Bytes(256 * 1024));
        let size = |s: &TcpStream| SockRef::from(s).send_buffer_size().unwrap();
        if cfg!(target_os = "linux") {
            // Linux reports twice what was asked (its bookkeeping), unless capped by
            // `net.core.wmem_max`: either way not the autotuned default's 16 KiB start.
            let cap = std::fs::read_to_string("/proc/sys/net/core/wmem_max")
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(usize::MAX);
            assert_eq!(size(&ours), 2 * (LOOPBACK_SEND_BUFFER as usize).min(cap));
            assert_eq!(size(&theirs), 2 * (256 * 1024usize).min(cap));
        } else {
            assert!(size(&ours) >= LOOPBACK_SEND_BUFFER as usize);
        }
    }

    /// `serve_tcp` counts on this to skip a `setsockopt` per connection.
    #[tokio::test]
    async fn accepted_sockets_inherit_nodelay_where_said() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let inherited = nodelay_inherited(&listener);
        assert_eq!(
            inherited,
            cfg!(any(target_os = "linux", target_os = "android"))
        );
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        if inherited {
            assert!(accepted.nodelay().unwrap());
        }
    }

    #[tokio::test]
    async fn connects_with_nodelay_and_carries_bytes_both_ways() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let mut s = Eager::new(s);
            let mut b = [0u8; 5];
            s.read_exact(&mut b).await.unwrap();
            s.write_all(b"world").await.unwrap();
            b
        });
        let stream = connect_tcp(addr, SendBuffer::Kernel).await.unwrap();
        assert!(stream.nodelay().unwrap());
        assert_eq!(stream.peer_addr().unwrap(), addr);
        let mut stream = Eager::new(stream);
        stream.write_all(b"hello").await.unwrap();
        let mut b = [0u8; 5];
        stream.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"world");
        assert_eq!(&server.await.unwrap(), b"hello");
        // The other side hung up: end of stream, not an error.
        assert_eq!(stream.read(&mut b).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_refused_connect_is_an_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let e = connect_tcp(addr, SendBuffer::Kernel).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    }

    #[tokio::test]
    async fn the_first_address_that_answers_is_used() {
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closed_addr = closed.local_addr().unwrap();
        drop(closed);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stream = connect_tcp(&[closed_addr, addr][..], SendBuffer::Kernel)
            .await
            .unwrap();
        assert_eq!(stream.peer_addr().unwrap(), addr);
    }

    /// More than the socket buffers hold, to a reader that starts late: the direct writes
    /// meet "would block" and tokio's readiness takes over without losing or reordering
    /// a byte, in plain and vectored writes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_past_a_full_socket_buffer_go_on_through_the_reactor() {
        const LEN: usize = 16 << 20;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + i / 4093) as u8).collect();
        let expected = data.clone();
        let reader = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            // Let the writer fill the buffers first.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            let mut s = Eager::new(s);
            let mut got = Vec::with_capacity(2 * LEN);
            s.read_to_end(&mut got).await.unwrap();
            got
        });
        let mut w = Eager::new(connect_tcp(addr, SendBuffer::Kernel).await.unwrap());
        assert!(w.is_write_vectored());
        w.write_all(&data[..LEN / 2]).await.unwrap();
        let (a, b) = data[LEN / 2..].split_at(LEN / 4);
        let mut left = [IoSlice::new(a), IoSlice::new(b)];
        let mut slices = &mut left[..];
        while !slices.is_empty() {
            let n = w.write_vectored(slices).await.unwrap();
            IoSlice::advance_slices(&mut slices, n);
        }
        assert!(
            !w.write_direct,
            "a 16 MB write should have met a full buffer"
        );
        w.shutdown().await.unwrap();
        let got = reader.await.unwrap();
        assert_eq!(got.len(), LEN);
        assert!(got == expected, "bytes lost or reordered");
    }

    #[tokio::test]
    async fn a_fresh_socket_takes_a_vectored_write_directly() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut w = Eager::new(connect_tcp(addr, SendBuffer::Kernel).await.unwrap());
        let (r, _) = listener.accept().await.unwrap();
        let slices = [IoSlice::new(b"head:"), IoSlice::new(b"body")];
        let n = std::future::poll_fn(|cx| Pin::new(&mut w).poll_write_vectored(cx, &slices))
            .await
            .unwrap();
        assert_eq!(n, 9);
        assert!(w.write_direct, "the kernel took it: still direct");
        drop(w);
        let mut got = Vec::new();
        Eager::new(r).read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"head:body");
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn unix_sockets_read_and_write_directly_too() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (mut a, mut b) = (Eager::new(a), Eager::new(b));
        a.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        b.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        // Nothing more to read yet: the next read falls back to the reactor and waits.
        let pending = tokio::time::timeout(std::time::Duration::from_millis(20), b.read(&mut buf));
        assert!(pending.await.is_err());
        assert!(!b.read_direct);
        a.write_all(b"pong").await.unwrap();
        b.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong");
    }
}
