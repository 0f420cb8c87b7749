//! A process without the job secret tries to use honest parties' own proofs: it sits between
//! a client and a server and forwards their bytes (verbatim, or with the connection views
//! rewritten to look consistent), or it opens two connections to one server and plays a
//! different role on each. Every attempt must be refused, and both honest sides must say why.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ciera_transport::auth::{self, Role};
use ciera_transport::TransportError;

const SECRET: [u8; 32] = *b"ciera-auth-relay-test-secret-001";

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

/// An honest server: accepts `n` connections and runs the handshake on each.
fn server(n: usize) -> (SocketAddr, JoinHandle<Vec<Result<String, TransportError>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let (mut s, _) = listener.accept().unwrap();
                std::thread::spawn(move || {
                    auth::handshake(&mut s, Role::Server, &SECRET, "srv", None, deadline())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (addr, t)
}

/// An honest client dialling `addr`, which it believes is the server "srv".
fn client(addr: SocketAddr) -> JoinHandle<Result<String, TransportError>> {
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        auth::handshake(
            &mut s,
            Role::Client,
            &SECRET,
            "cli",
            Some("srv"),
            deadline(),
        )
    })
}

/// Reads one version 2 hello (see auth.rs): magic, version, role, nonce, identity, view.
fn read_hello(s: &mut TcpStream) -> Vec<u8> {
    let mut h = vec![0u8; 8 + 1 + 1 + 32 + 1];
    s.read_exact(&mut h).unwrap();
    assert_eq!((&h[..8], h[8]), (&b"CIERAUTH"[..], auth::VERSION));
    let id_len = h[42] as usize;
    let at = h.len();
    h.resize(at + id_len + 2 * 19, 0);
    s.read_exact(&mut h[at..]).unwrap();
    h
}

fn endpoint(a: SocketAddr) -> Vec<u8> {
    let SocketAddr::V4(a) = a else {
        panic!("IPv4 only here")
    };
    let mut e = vec![4u8];
    e.extend_from_slice(&a.ip().octets());
    e.extend_from_slice(&[0; 12]);
    e.extend_from_slice(&a.port().to_le_bytes());
    e
}

/// `hello` with its view replaced by (local, peer).
fn with_view(hello: &[u8], local: SocketAddr, peer: SocketAddr) -> Vec<u8> {
    let mut h = hello[..hello.len() - 38].to_vec();
    h.extend_from_slice(&endpoint(local));
    h.extend_from_slice(&endpoint(peer));
    h
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 4096];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}

/// The attacker: takes the client's connection, dials the server, forwards both hellos (with
/// the views rewritten to mirror each other if `rewrite`), then every byte either way.
fn relay(server: SocketAddr, rewrite: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut c, _) = listener.accept().unwrap();
        let mut s = TcpStream::connect(server).unwrap();
        let mut from_client = read_hello(&mut c);
        let mut from_server = read_hello(&mut s);
        if rewrite {
            // What the server sees, as if the client had sent it, and the other way round.
            from_client = with_view(&from_client, s.local_addr().unwrap(), server);
            from_server = with_view(
                &from_server,
                c.local_addr().unwrap(),
                c.peer_addr().unwrap(),
            );
        }
        s.write_all(&from_client).unwrap();
        c.write_all(&from_server).unwrap();
        let (c2, s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
        std::thread::spawn(move || pump(c2, s2));
        pump(s, c);
    });
    addr
}

fn auth_error(r: Result<String, TransportError>, who: &str, needle: &str) {
    match r {
        Err(e @ TransportError::Auth { .. }) if e.to_string().contains(needle) => {
            eprintln!("{who}: {e}");
        }
        other => panic!("{who}: expected an Auth error saying {needle:?}, got {other:?}"),
    }
}

#[test]
fn a_relay_between_two_honest_parties_is_refused_by_both() {
    let (srv, server_results) = server(1);
    let proxy = relay(srv, false);
    let c = client(proxy).join().unwrap();
    let s = server_results.join().unwrap().pop().unwrap();
    auth_error(c, "client", "relays between two connections");
    auth_error(s, "server", "relays between two connections");
}

#[test]
fn a_relay_that_rewrites_the_views_fails_the_proofs() {
    let (srv, server_results) = server(1);
    let proxy = relay(srv, true);
    let c = client(proxy).join().unwrap();
    let s = server_results.join().unwrap().pop().unwrap();
    auth_error(s, "server", "failed the challenge");
    auth_error(c, "client", "refused our proof");
}

#[test]
fn a_direct_connection_with_the_same_secret_succeeds() {
    // The control for the two tests above: same parties, no one in between.
    let (srv, server_results) = server(1);
    assert_eq!(client(srv).join().unwrap().unwrap(), "srv");
    assert_eq!(
        server_results.join().unwrap().pop().unwrap().unwrap(),
        "cli"
    );
}

#[test]
fn two_connections_to_one_server_yield_no_proof_to_relay() {
    // On one connection the attacker claims to be the server too (in version 1 the roles
    // followed the address order, so it could make the honest side prove itself as the
    // connecting side); on the other it plays the client and has nothing to prove with.
    let (srv, server_results) = server(2);
    let mut a = TcpStream::connect(srv).unwrap();
    let mut b = TcpStream::connect(srv).unwrap();
    let hello_a = read_hello(&mut a);
    let hello_b = read_hello(&mut b);
    // a: the server's own hello back with our view, as a second server.
    let mut as_server = with_view(&hello_a, a.local_addr().unwrap(), srv);
    as_server[9] = 1; // role: server
    a.write_all(&as_server).unwrap();
    // b: a client hello, and the only bytes the server ever sent us as the "proof".
    let mut as_client = with_view(&hello_b, b.local_addr().unwrap(), srv);
    as_client[9] = 0;
    as_client[10] ^= 0xFF; // not an echo of the server's nonce
    b.write_all(&as_client).unwrap();
    b.write_all(&hello_a[10..42]).unwrap();
    // Each connection gets at most a refusal byte, never a proof.
    let mut rest_a = Vec::new();
    let _ = a.read_to_end(&mut rest_a);
    let mut rest_b = Vec::new();
    let _ = b.read_to_end(&mut rest_b);
    assert_eq!(rest_a, b"", "a second server was answered");
    assert_eq!(
        rest_b,
        [1],
        "the server answered a proof it never made with more than a refusal"
    );
    let mut results = server_results.join().unwrap();
    results.sort_by_key(|r| format!("{r:?}"));
    let texts: Vec<String> = results
        .into_iter()
        .map(|r| r.unwrap_err().to_string())
        .collect();
    assert!(
        texts.iter().any(|t| t.contains("failed the challenge")),
        "{texts:?}"
    );
    assert!(
        texts.iter().any(|t| t.contains("both ends act as server")),
        "{texts:?}"
    );
}
