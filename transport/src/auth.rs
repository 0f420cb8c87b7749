//! Mutual challenge-response authentication with a shared 32-byte job secret, bound to the
//! direction and to the connection.
//!
//! Roles come from the call, never from addresses: the side that called `connect` is the
//! [`Role::Client`], the side that called `accept` the [`Role::Server`].
//!
//! Protocol version 2 (on one connected stream; the secret never crosses the wire):
//!
//! 1. Both sides send at once
//!    `HELLO = "CIERAUTH" | version u8 = 2 | role u8 (0 client, 1 server) | nonce [32]
//!    | identity (u8 length, UTF-8) | view`,
//!    where the identity says who the side is and what for (`bootstrap root`,
//!    `link rank 2 of 4 pid 77`), and the view is the connection as this side sees it: its
//!    local endpoint, then its peer's, each `family u8 (4|6) | IP [16] (IPv4 in the first 4)
//!    | port u16`.
//! 2. Each side checks the other's hello: the same version (else a `Protocol` error naming
//!    both), the other role, another nonce, the identity it expects (if it expects one), and,
//!    when the peer's address is one of this host's, that the peer's view mirrors its own.
//! 3. With `T = u16 len | client HELLO | u16 len | server HELLO`, the client sends
//!    `proof_c = HMAC-SHA256(secret, "ciera-auth-v2 client" | T)`.
//! 4. The server checks `proof_c` against the client label (constant time). Wrong: it sends
//!    verdict `1` and fails with `Auth`. Right: verdict `0` and
//!    `proof_s = HMAC(secret, "ciera-auth-v2 server" | T)`.
//! 5. The client checks `proof_s` against the server label and sends a final verdict byte
//!    (`0` accepted, `1` refused), so both sides learn the outcome.
//!
//! Why each part:
//! * Direction: a side's role is fixed by what it called, each proof carries its role's label
//!   and each verifier accepts only the other role's label. A server therefore never computes
//!   a client proof. (Version 1 derived the role from comparing the two addresses; a local
//!   process without the secret chose its source address so that the root acted as connector
//!   on one connection and acceptor on another, and relayed the root's own proof between
//!   them.)
//! * Connection: the proofs cover both fresh nonces and both hellos whole, identities and
//!   views included, so a proof is valid only on the connection it was made for, for the
//!   purpose and parties it names.
//! * Relay: a process that sits between two honest parties and forwards bytes holds two
//!   connections with different endpoints. On one host no address translation exists, so
//!   the views must mirror each other, and both honest sides refuse; rewriting the views in
//!   transit changes the transcript one side MACs, so the proofs fail. Between hosts, address
//!   translation (NAT, container networks) is common, so the views are covered by the MAC but
//!   not compared.
//!
//! This authenticates the two endpoints of a connection; it does not encrypt or MAC the bytes
//! that follow (see SECURITY.md: the threat is stray or foreign processes, not an attacker on
//! the network path).

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::wire::{read_exact_by, write_all_by};
use crate::{Result, TransportError};

const MAGIC: &[u8; 8] = b"CIERAUTH";
/// Version 1 (roles from address order, proofs over the nonces only) is refused by name.
pub const VERSION: u8 = 2;
const NONCE_BYTES: usize = 32;
/// Magic and version: read first, so a peer of another version is named, not misparsed.
const PREFIX_BYTES: usize = 8 + 1;
/// Longest identity a side may claim.
pub const MAX_IDENTITY_BYTES: usize = 255;
const ENDPOINT_BYTES: usize = 1 + 16 + 2;
const VIEW_BYTES: usize = 2 * ENDPOINT_BYTES;
const PROOF_BYTES: usize = 32;
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;

/// Which end of the connection this side is, by construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that called `connect` (proves itself first).
    Client,
    /// The side that called `accept` (verifies first, then proves itself).
    Server,
}

impl Role {
    fn code(self) -> u8 {
        match self {
            Role::Client => 0,
            Role::Server => 1,
        }
    }
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"ciera-auth-v2 client",
            Role::Server => b"ciera-auth-v2 server",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Server => "server",
        }
    }
}

/// The connection as one side sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct View {
    local: SocketAddr,
    peer: SocketAddr,
}

/// IPv4-mapped IPv6 addresses as IPv4, no flow info or scope: what both ends can agree on.
fn normalize(a: SocketAddr) -> SocketAddr {
    let ip = match a.ip() {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    };
    SocketAddr::new(ip, a.port())
}

fn put_endpoint(out: &mut Vec<u8>, a: SocketAddr) {
    let mut ip = [0u8; 16];
    let family = match a.ip() {
        IpAddr::V4(v4) => {
            ip[..4].copy_from_slice(&v4.octets());
            4
        }
        IpAddr::V6(v6) => {
            ip.copy_from_slice(&v6.octets());
            6
        }
    };
    out.push(family);
    out.extend_from_slice(&ip);
    out.extend_from_slice(&a.port().to_le_bytes());
}

fn get_endpoint(b: &[u8]) -> Option<SocketAddr> {
    let port = u16::from_le_bytes([b[17], b[18]]);
    let ip = match b[0] {
        4 => IpAddr::from([b[1], b[2], b[3], b[4]]),
        6 => IpAddr::from(<[u8; 16]>::try_from(&b[1..17]).ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Whether `ip` belongs to this host (loopback, or an IPv4 address of one of its interfaces):
/// then nothing can translate addresses between the two ends.
fn on_this_host(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_loopback()
                || crate::ipv4_interfaces().is_ok_and(|all| all.iter().any(|i| i.ip == v4))
        }
        IpAddr::V6(v6) => v6.is_loopback(),
    }
}

/// A peer's hello, parsed.
struct Hello {
    role: u8,
    nonce: [u8; NONCE_BYTES],
    identity: String,
    view: View,
}

fn encode_hello(role: Role, nonce: &[u8; NONCE_BYTES], identity: &str, view: View) -> Vec<u8> {
    let mut h = Vec::with_capacity(PREFIX_BYTES + 2 + NONCE_BYTES + identity.len() + VIEW_BYTES);
    h.extend_from_slice(MAGIC);
    h.push(VERSION);
    h.push(role.code());
    h.extend_from_slice(nonce);
    h.push(identity.len() as u8);
    h.extend_from_slice(identity.as_bytes());
    put_endpoint(&mut h, view.local);
    put_endpoint(&mut h, view.peer);
    h
}

/// Reads the peer's hello; returns it parsed and as the bytes it was sent as.
fn read_hello(stream: &mut TcpStream, deadline: Instant, peer: &str) -> Result<(Hello, Vec<u8>)> {
    let step = |what: &str| format!("auth handshake with {peer}: {what}");
    let protocol = |detail: String| TransportError::Protocol {
        detail: step(&detail),
    };
    let mut raw = vec![0u8; PREFIX_BYTES];
    read_exact_by(stream, &mut raw, deadline, &step("waiting for hello"))?;
    if &raw[..8] != MAGIC {
        return Err(protocol(format!(
            "peer is not a CIERA rank (bad magic {:02x?})",
            &raw[..8]
        )));
    }
    if raw[8] != VERSION {
        return Err(protocol(format!(
            "the peer speaks auth protocol version {}, this side version {VERSION} (every \
             process of a job must run the same CIERA release)",
            raw[8]
        )));
    }
    let fixed = 1 + NONCE_BYTES + 1;
    raw.resize(PREFIX_BYTES + fixed, 0);
    read_exact_by(
        stream,
        &mut raw[PREFIX_BYTES..],
        deadline,
        &step("reading hello"),
    )?;
    let id_len = raw[PREFIX_BYTES + fixed - 1] as usize;
    let at = raw.len();
    raw.resize(at + id_len + VIEW_BYTES, 0);
    read_exact_by(stream, &mut raw[at..], deadline, &step("reading hello"))?;
    let role = raw[PREFIX_BYTES];
    let mut nonce = [0u8; NONCE_BYTES];
    nonce.copy_from_slice(&raw[PREFIX_BYTES + 1..PREFIX_BYTES + 1 + NONCE_BYTES]);
    let identity = String::from_utf8(raw[at..at + id_len].to_vec())
        .map_err(|_| protocol("the peer's identity is not UTF-8".into()))?;
    let v = &raw[at + id_len..];
    let (Some(local), Some(their_peer)) = (
        get_endpoint(&v[..ENDPOINT_BYTES]),
        get_endpoint(&v[ENDPOINT_BYTES..]),
    ) else {
        return Err(protocol(
            "the peer's view has an unknown address family".into(),
        ));
    };
    let hello = Hello {
        role,
        nonce,
        identity,
        view: View {
            local: normalize(local),
            peer: normalize(their_peer),
        },
    };
    Ok((hello, raw))
}

/// Mutual challenge-response on a connected blocking stream; both ends call it, the one that
/// connected as [`Role::Client`], the one that accepted as [`Role::Server`].
///
/// `me` is this side's identity (at most [`MAX_IDENTITY_BYTES`]); `expect`, if given, is the
/// identity the peer must claim (a client knows whom it dialled). Returns the identity the
/// peer proved, for the caller to check against what the peer says next. On return the stream
/// is blocking with no read/write timeouts, positioned right after the handshake.
pub fn handshake(
    stream: &mut TcpStream,
    role: Role,
    secret: &[u8; 32],
    me: &str,
    expect: Option<&str>,
    deadline: Instant,
) -> Result<String> {
    if me.len() > MAX_IDENTITY_BYTES {
        return Err(TransportError::Config {
            detail: format!(
                "auth identity {me:?} is {} bytes (limit {MAX_IDENTITY_BYTES})",
                me.len()
            ),
        });
    }
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown peer".into());
    stream.set_nonblocking(false).map_err(|e| {
        TransportError::io(
            "set socket blocking",
            format!("auth handshake with {peer}"),
            e,
        )
    })?;
    let result = run(stream, role, secret, me, expect, deadline, &peer);
    // Leave the stream as a plain blocking stream for the caller.
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    result
}

fn my_view(stream: &TcpStream, peer: &str) -> Result<View> {
    let what = format!("auth handshake with {peer}");
    let local = stream
        .local_addr()
        .map_err(|e| TransportError::io("getsockname", &what, e))?;
    let their = stream
        .peer_addr()
        .map_err(|e| TransportError::io("getpeername", &what, e))?;
    Ok(View {
        local: normalize(local),
        peer: normalize(their),
    })
}

/// Why this side will not go on with `theirs`, before any proof is sent.
fn check_hello(
    role: Role,
    mine: &View,
    my_nonce: &[u8],
    theirs: &Hello,
    expect: Option<&str>,
    peer: &str,
) -> Result<()> {
    if theirs.role > 1 || theirs.role == role.code() {
        return Err(TransportError::Protocol {
            detail: format!(
                "auth handshake with {peer}: both ends act as {} (the side that connects is \
                 the client, the side that accepts the server)",
                if theirs.role == role.code() {
                    role.name()
                } else {
                    "an unknown role"
                }
            ),
        });
    }
    if theirs.nonce[..] == my_nonce[..] {
        return Err(TransportError::Auth {
            detail: format!("auth handshake with {peer}: the peer echoed our nonce (a reflection)"),
        });
    }
    if let Some(want) = expect {
        if theirs.identity != want {
            return Err(TransportError::Auth {
                detail: format!(
                    "auth handshake with {peer}: expected {want:?}, but the peer says it is {:?}",
                    theirs.identity
                ),
            });
        }
    }
    let mirrored = theirs.view.local == mine.peer && theirs.view.peer == mine.local;
    if !mirrored && on_this_host(mine.peer.ip()) {
        return Err(TransportError::Auth {
            detail: format!(
                "auth handshake with {peer}: the two ends see different connections (this side \
                 {} <-> {}, the peer {} <-> {}): someone relays between two connections; refused",
                mine.local, mine.peer, theirs.view.local, theirs.view.peer
            ),
        });
    }
    Ok(())
}

fn run(
    stream: &mut TcpStream,
    role: Role,
    secret: &[u8; 32],
    me: &str,
    expect: Option<&str>,
    deadline: Instant,
    peer: &str,
) -> Result<String> {
    let mut my_nonce = [0u8; NONCE_BYTES];
    crate::sys::fill_random(&mut my_nonce)
        .map_err(|e| TransportError::io("getrandom", "auth handshake nonce", e))?;
    let view = my_view(stream, peer)?;
    let my_hello = encode_hello(role, &my_nonce, me, view);
    write_all_by(
        stream,
        &my_hello,
        deadline,
        &format!("auth handshake with {peer}: sending hello"),
    )?;
    let (theirs, their_hello) = read_hello(stream, deadline, peer)?;
    check_hello(role, &view, &my_nonce, &theirs, expect, peer)?;

    let (client_hello, server_hello) = match role {
        Role::Client => (&my_hello, &their_hello),
        Role::Server => (&their_hello, &my_hello),
    };
    let mac = |label: Role| -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts any key length");
        m.update(label.label());
        for h in [client_hello, server_hello] {
            m.update(&(h.len() as u16).to_le_bytes());
            m.update(h);
        }
        m
    };
    let failed = || TransportError::Auth {
        detail: format!(
            "{peer} failed the challenge (it does not hold this job's secret, or the handshake \
             was altered on its way)"
        ),
    };

    match role {
        Role::Client => {
            let proof = mac(Role::Client).finalize().into_bytes();
            write_all_by(
                stream,
                &proof,
                deadline,
                &format!("auth handshake with {peer}: sending proof"),
            )?;
            read_verdict(stream, deadline, peer)?;
            let their_proof = read_proof(stream, deadline, peer)?;
            // verify_slice compares in constant time.
            let ok = mac(Role::Server).verify_slice(&their_proof).is_ok();
            let final_verdict = [if ok { ACCEPTED } else { REFUSED }];
            write_all_by(
                stream,
                &final_verdict,
                deadline,
                &format!("auth handshake with {peer}: sending verdict"),
            )?;
            if !ok {
                return Err(failed());
            }
        }
        Role::Server => {
            let their_proof = read_proof(stream, deadline, peer)?;
            if mac(Role::Client).verify_slice(&their_proof).is_err() {
                // Best effort: tell the peer why it is being dropped.
                let _ = write_all_by(
                    stream,
                    &[REFUSED],
                    deadline,
                    "auth handshake: sending refusal",
                );
                return Err(failed());
            }
            let mut reply = [0u8; 1 + PROOF_BYTES];
            reply[0] = ACCEPTED;
            reply[1..].copy_from_slice(&mac(Role::Server).finalize().into_bytes());
            write_all_by(
                stream,
                &reply,
                deadline,
                &format!("auth handshake with {peer}: sending proof"),
            )?;
            read_verdict(stream, deadline, peer)?;
        }
    }
    Ok(theirs.identity)
}

/// Reads the peer's verdict on our proof; a refusal means the two sides hold different secrets.
fn read_verdict(stream: &mut TcpStream, deadline: Instant, peer: &str) -> Result<()> {
    let mut verdict = [0u8; 1];
    read_exact_by(
        stream,
        &mut verdict,
        deadline,
        &format!("auth handshake with {peer}: waiting for verdict"),
    )?;
    if verdict[0] != ACCEPTED {
        return Err(TransportError::Auth {
            detail: format!(
                "{peer} refused our proof: the two sides hold different job secrets (or the \
                 handshake was altered on its way)"
            ),
        });
    }
    Ok(())
}

/// Reads the peer's proof (its HMAC over the transcript).
fn read_proof(stream: &mut TcpStream, deadline: Instant, peer: &str) -> Result<[u8; PROOF_BYTES]> {
    let mut proof = [0u8; PROOF_BYTES];
    read_exact_by(
        stream,
        &mut proof,
        deadline,
        &format!("auth handshake with {peer}: waiting for proof"),
    )?;
    Ok(proof)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    fn run_pair(
        client_secret: [u8; 32],
        server_secret: [u8; 32],
        expect: Option<&'static str>,
    ) -> (Result<String>, Result<String>, TcpStream, TcpStream) {
        let (mut client, mut server) = pair();
        let t = std::thread::spawn(move || {
            let r = handshake(
                &mut server,
                Role::Server,
                &server_secret,
                "srv",
                None,
                deadline(),
            );
            (r, server)
        });
        let a = handshake(
            &mut client,
            Role::Client,
            &client_secret,
            "cli",
            expect,
            deadline(),
        );
        let (b, server) = t.join().unwrap();
        (a, b, client, server)
    }

    #[test]
    fn same_secret_succeeds_names_both_ends_and_leaves_stream_usable() {
        let (a, b, mut client, mut server) = run_pair([7; 32], [7; 32], Some("srv"));
        assert_eq!(a.unwrap(), "srv");
        assert_eq!(b.unwrap(), "cli");
        client.write_all(b"after").unwrap();
        let mut got = [0u8; 5];
        server.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"after");
    }

    #[test]
    fn different_secrets_fail_with_auth_on_both_sides() {
        let (a, b, _, _) = run_pair([7; 32], [8; 32], None);
        assert!(matches!(a, Err(TransportError::Auth { .. })), "{a:?}");
        assert!(matches!(b, Err(TransportError::Auth { .. })), "{b:?}");
    }

    #[test]
    fn a_server_that_is_not_the_expected_party_is_refused_before_any_proof() {
        let (mut client, mut server) = pair();
        let t = std::thread::spawn(move || {
            handshake(&mut server, Role::Server, &[7; 32], "srv", None, deadline())
        });
        let a = handshake(
            &mut client,
            Role::Client,
            &[7; 32],
            "cli",
            Some("link rank 1 of 2 pid 5"),
            deadline(),
        );
        drop(client);
        let b = t.join().unwrap();
        let a = a.unwrap_err();
        assert!(
            matches!(a, TransportError::Auth { .. })
                && a.to_string()
                    .contains("expected \"link rank 1 of 2 pid 5\"")
                && a.to_string().contains("\"srv\""),
            "{a}"
        );
        // The server got no proof: the client hung up.
        assert!(b.unwrap_err().is_peer_closed());
    }

    #[test]
    fn same_roles_are_a_protocol_error() {
        let (mut client, mut server) = pair();
        let t = std::thread::spawn(move || {
            handshake(&mut server, Role::Client, &[1; 32], "x", None, deadline())
        });
        let a = handshake(&mut client, Role::Client, &[1; 32], "y", None, deadline());
        let b = t.join().unwrap();
        for r in [a, b] {
            let e = r.unwrap_err();
            assert!(
                matches!(e, TransportError::Protocol { .. })
                    && e.to_string().contains("both ends act as client"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_reflected_hello_is_refused() {
        // An attacker that echoes the server's hello back (as a client) gets nowhere.
        let (mut client, mut server) = pair();
        let t = std::thread::spawn(move || {
            handshake(&mut server, Role::Server, &[1; 32], "srv", None, deadline())
        });
        let mut hello = vec![0u8; PREFIX_BYTES + 2 + NONCE_BYTES + 3 + VIEW_BYTES];
        client.read_exact(&mut hello).unwrap();
        hello[PREFIX_BYTES] = Role::Client.code();
        client.write_all(&hello).unwrap();
        let r = t.join().unwrap();
        assert!(matches!(r, Err(TransportError::Auth { .. })), "{r:?}");
    }

    #[test]
    fn a_version_1_peer_is_named_on_both_sides_not_hung() {
        let (mut old, mut server) = pair();
        // A version 1 hello: magic, version, role, nonce (42 bytes).
        let mut v1 = b"CIERAUTH".to_vec();
        v1.extend_from_slice(&[1, 0]);
        v1.extend_from_slice(&[9; 32]);
        old.write_all(&v1).unwrap();
        let r = handshake(&mut server, Role::Server, &[1; 32], "srv", None, deadline());
        let e = r.unwrap_err();
        assert!(
            matches!(e, TransportError::Protocol { .. })
                && e.to_string().contains("version 1, this side version 2"),
            "{e}"
        );
        // What a version 1 build reads (42 bytes) names version 2 in the same place.
        let mut theirs = [0u8; 42];
        old.read_exact(&mut theirs).unwrap();
        assert_eq!((&theirs[..8], theirs[8]), (&MAGIC[..], 2));
    }

    #[test]
    fn garbage_and_silence_are_reported_not_hung() {
        let (mut client, mut server) = pair();
        client
            .write_all(b"GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")
            .unwrap();
        let r = handshake(&mut server, Role::Server, &[1; 32], "s", None, deadline());
        assert!(matches!(r, Err(TransportError::Protocol { .. })), "{r:?}");

        let (_silent, mut server) = pair();
        let r = handshake(
            &mut server,
            Role::Server,
            &[1; 32],
            "s",
            None,
            Instant::now() + Duration::from_millis(100),
        );
        assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");

        let (client, mut server) = pair();
        drop(client);
        let r = handshake(&mut server, Role::Server, &[1; 32], "s", None, deadline());
        assert!(matches!(r, Err(TransportError::PeerClosed { .. })), "{r:?}");
    }

    #[test]
    fn views_round_trip_and_normalize() {
        for a in ["10.1.2.3:4", "[fe80::1]:9", "[::ffff:127.0.0.1]:80"] {
            let a: SocketAddr = a.parse().unwrap();
            let mut b = Vec::new();
            put_endpoint(&mut b, normalize(a));
            assert_eq!(b.len(), ENDPOINT_BYTES);
            assert_eq!(get_endpoint(&b), Some(normalize(a)));
        }
        assert_eq!(
            normalize("[::ffff:127.0.0.1]:80".parse().unwrap()),
            "127.0.0.1:80".parse().unwrap()
        );
        assert!(on_this_host("127.0.0.9".parse().unwrap()));
        assert!(!on_this_host("192.0.2.1".parse().unwrap()));
    }

    #[test]
    fn an_overlong_identity_is_a_config_error() {
        let (mut client, _server) = pair();
        let me = "x".repeat(MAX_IDENTITY_BYTES + 1);
        let r = handshake(&mut client, Role::Client, &[1; 32], &me, None, deadline());
        assert!(matches!(r, Err(TransportError::Config { .. })), "{r:?}");
    }
}
