//! Mutual challenge-response authentication with a shared 32-byte job secret.
//!
//! Protocol (all on one connected stream; the secret never crosses the wire):
//!
//! 1. Both sides send `HELLO = "CIERAUTH" | version u8 | role u8 | nonce [32]` at once.
//!    Roles must differ (one `Connector`, one `Acceptor`) and the nonces must differ.
//! 2. The connector sends `proof_c = HMAC-SHA256(secret, "ciera-auth-v1/connector" | n_acc | n_con)`.
//! 3. The acceptor checks it (constant time). Wrong: it sends verdict `1` and fails with `Auth`.
//!    Right: it sends verdict `0` and `proof_a = HMAC(secret, "ciera-auth-v1/acceptor" | n_acc | n_con)`.
//! 4. The connector checks `proof_a` and sends a final verdict byte (`0` accepted, `1` refused),
//!    so both sides learn the outcome and a failure is `Auth` on both sides.
//!
//! Why roles: in a symmetric protocol an attacker can open two connections to the same honest
//! process and reflect the proof it computes in one into the other. Here an acceptor only ever
//! emits acceptor-labelled proofs, and only after the peer proved itself; connector-labelled
//! proofs are only produced on connections an honest rank opened itself to an address from the
//! bootstrap. Fresh random nonces on both sides make replays useless.
//!
//! This authenticates the two endpoints of a connection; it does not encrypt or MAC the bytes
//! that follow (the threat is stray or foreign processes, not an on-path attacker).

use std::net::TcpStream;
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::wire::{read_exact_by, write_all_by};
use crate::{Result, TransportError};

const MAGIC: &[u8; 8] = b"CIERAUTH";
const VERSION: u8 = 1;
const NONCE_BYTES: usize = 32;
const HELLO_BYTES: usize = 8 + 1 + 1 + NONCE_BYTES;
const PROOF_BYTES: usize = 32;
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;

/// Which end of the connection this side is; the two ends must take different roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that called `connect` (proves itself first).
    Connector,
    /// The side that called `accept` (verifies first, then proves itself).
    Acceptor,
}

impl Role {
    fn code(self) -> u8 {
        match self {
            Role::Connector => 0,
            Role::Acceptor => 1,
        }
    }
    fn label(self) -> &'static [u8] {
        match self {
            Role::Connector => b"ciera-auth-v1/connector",
            Role::Acceptor => b"ciera-auth-v1/acceptor",
        }
    }
}

/// Mutual challenge-response on an already-connected blocking stream; both sides call it.
///
/// The roles are derived from the connection's address pair (the end with the smaller local
/// `SocketAddr` acts as connector), which both ends see mirrored. Behind NAT the two ends may
/// derive the same role; that is reported as a `Protocol` error. Prefer [`handshake_as`] when
/// the caller knows which side connected: it is immune to address rewriting and gives an
/// attacker on the same host no way to choose our role.
pub fn handshake(stream: &mut TcpStream, secret: &[u8; 32], deadline: Instant) -> Result<()> {
    let local = stream
        .local_addr()
        .map_err(|e| TransportError::io("getsockname", "auth handshake", e))?;
    let peer = stream
        .peer_addr()
        .map_err(|e| TransportError::io("getpeername", "auth handshake", e))?;
    let role = match local.cmp(&peer) {
        std::cmp::Ordering::Less => Role::Connector,
        std::cmp::Ordering::Greater => Role::Acceptor,
        std::cmp::Ordering::Equal => {
            return Err(TransportError::Protocol {
                detail: format!("auth handshake: the stream at {local} is connected to itself"),
            })
        }
    };
    handshake_as(stream, role, secret, deadline)
}

/// [`handshake`] with an explicit role (the caller knows whether it connected or accepted).
/// On return the stream is blocking with no read/write timeouts, positioned right after the
/// handshake (nothing beyond it has been read).
pub fn handshake_as(
    stream: &mut TcpStream,
    role: Role,
    secret: &[u8; 32],
    deadline: Instant,
) -> Result<()> {
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
    let result = run(stream, role, secret, deadline, &peer);
    // Leave the stream as a plain blocking stream for the caller.
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    result
}

fn run(
    stream: &mut TcpStream,
    role: Role,
    secret: &[u8; 32],
    deadline: Instant,
    peer: &str,
) -> Result<()> {
    let mut my_nonce = [0u8; NONCE_BYTES];
    crate::sys::fill_random(&mut my_nonce)
        .map_err(|e| TransportError::io("getrandom", "auth handshake nonce", e))?;

    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.push(role.code());
    hello.extend_from_slice(&my_nonce);
    write_all_by(
        stream,
        &hello,
        deadline,
        &format!("auth handshake with {peer}: sending hello"),
    )?;

    let mut theirs = [0u8; HELLO_BYTES];
    read_exact_by(
        stream,
        &mut theirs,
        deadline,
        &format!("auth handshake with {peer}: waiting for hello"),
    )?;
    if &theirs[..8] != MAGIC {
        return Err(TransportError::Protocol {
            detail: format!(
                "auth handshake with {peer}: peer is not a CIERA rank (bad magic {:02x?})",
                &theirs[..8]
            ),
        });
    }
    if theirs[8] != VERSION {
        return Err(TransportError::Protocol {
            detail: format!(
                "auth handshake with {peer}: peer speaks version {}, this side {VERSION}",
                theirs[8]
            ),
        });
    }
    if theirs[9] > 1 || theirs[9] == role.code() {
        return Err(TransportError::Protocol {
            detail: format!(
                "auth handshake with {peer}: both ends took the role code {} (this side is {role:?}); \
                 use auth::handshake_as when addresses are rewritten (NAT)",
                theirs[9]
            ),
        });
    }
    let mut peer_nonce = [0u8; NONCE_BYTES];
    peer_nonce.copy_from_slice(&theirs[10..]);
    if peer_nonce == my_nonce {
        return Err(TransportError::Auth {
            detail: format!(
                "auth handshake with {peer}: peer echoed our nonce (reflection attempt?)"
            ),
        });
    }
    let (acc_nonce, con_nonce) = match role {
        Role::Acceptor => (&my_nonce, &peer_nonce),
        Role::Connector => (&peer_nonce, &my_nonce),
    };
    let mac = |label: Role| -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts any key length");
        m.update(label.label());
        m.update(acc_nonce);
        m.update(con_nonce);
        m
    };

    match role {
        Role::Connector => {
            let proof = mac(Role::Connector).finalize().into_bytes();
            write_all_by(
                stream,
                &proof,
                deadline,
                &format!("auth handshake with {peer}: sending proof"),
            )?;
            read_verdict(stream, deadline, peer)?;
            let their_proof = read_proof(stream, deadline, peer)?;
            let ok = mac(Role::Acceptor).verify_slice(&their_proof).is_ok();
            let final_verdict = [if ok { ACCEPTED } else { REFUSED }];
            write_all_by(
                stream,
                &final_verdict,
                deadline,
                &format!("auth handshake with {peer}: sending verdict"),
            )?;
            if !ok {
                return Err(TransportError::Auth {
                    detail: format!(
                        "{peer} failed the challenge (it does not hold this job's secret)"
                    ),
                });
            }
        }
        Role::Acceptor => {
            let their_proof = read_proof(stream, deadline, peer)?;
            if mac(Role::Connector).verify_slice(&their_proof).is_err() {
                // Best effort: tell the peer why it is being dropped.
                let _ = write_all_by(
                    stream,
                    &[REFUSED],
                    deadline,
                    "auth handshake: sending refusal",
                );
                return Err(TransportError::Auth {
                    detail: format!(
                        "{peer} failed the challenge (it does not hold this job's secret)"
                    ),
                });
            }
            let mut reply = [0u8; 1 + PROOF_BYTES];
            reply[0] = ACCEPTED;
            reply[1..].copy_from_slice(&mac(Role::Acceptor).finalize().into_bytes());
            write_all_by(
                stream,
                &reply,
                deadline,
                &format!("auth handshake with {peer}: sending proof"),
            )?;
            read_verdict(stream, deadline, peer)?;
        }
    }
    Ok(())
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
            detail: format!("{peer} refused our proof: the two sides hold different job secrets"),
        });
    }
    Ok(())
}

/// Reads the peer's proof (its HMAC over both nonces).
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
        a_secret: [u8; 32],
        b_secret: [u8; 32],
        explicit: bool,
    ) -> (Result<()>, Result<()>, TcpStream, TcpStream) {
        let (mut client, mut server) = pair();
        let t = std::thread::spawn(move || {
            let r = if explicit {
                handshake_as(&mut server, Role::Acceptor, &b_secret, deadline())
            } else {
                handshake(&mut server, &b_secret, deadline())
            };
            (r, server)
        });
        let a = if explicit {
            handshake_as(&mut client, Role::Connector, &a_secret, deadline())
        } else {
            handshake(&mut client, &a_secret, deadline())
        };
        let (b, server) = t.join().unwrap();
        (a, b, client, server)
    }

    #[test]
    fn same_secret_succeeds_and_leaves_stream_usable() {
        for explicit in [true, false] {
            let (a, b, mut client, mut server) = run_pair([7; 32], [7; 32], explicit);
            a.unwrap();
            b.unwrap();
            client.write_all(b"after").unwrap();
            let mut got = [0u8; 5];
            server.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"after");
        }
    }

    #[test]
    fn different_secrets_fail_with_auth_on_both_sides() {
        for explicit in [true, false] {
            let (a, b, _, _) = run_pair([7; 32], [8; 32], explicit);
            assert!(matches!(a, Err(TransportError::Auth { .. })), "{a:?}");
            assert!(matches!(b, Err(TransportError::Auth { .. })), "{b:?}");
        }
    }

    #[test]
    fn same_roles_are_a_protocol_error() {
        let (mut client, mut server) = pair();
        let t = std::thread::spawn(move || {
            handshake_as(&mut server, Role::Connector, &[1; 32], deadline())
        });
        let a = handshake_as(&mut client, Role::Connector, &[1; 32], deadline());
        assert!(matches!(a, Err(TransportError::Protocol { .. })), "{a:?}");
        assert!(matches!(
            t.join().unwrap(),
            Err(TransportError::Protocol { .. })
        ));
    }

    #[test]
    fn reflected_nonce_is_refused() {
        // An attacker that echoes the acceptor's hello back must not get anywhere.
        let (mut client, mut server) = pair();
        let t = std::thread::spawn(move || {
            handshake_as(&mut server, Role::Acceptor, &[1; 32], deadline())
        });
        let mut hello = [0u8; HELLO_BYTES];
        client.read_exact(&mut hello).unwrap();
        hello[9] = Role::Connector.code();
        client.write_all(&hello).unwrap();
        let r = t.join().unwrap();
        assert!(matches!(r, Err(TransportError::Auth { .. })), "{r:?}");
    }

    #[test]
    fn garbage_and_silence_are_reported_not_hung() {
        let (mut client, mut server) = pair();
        client
            .write_all(b"GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")
            .unwrap();
        let r = handshake_as(&mut server, Role::Acceptor, &[1; 32], deadline());
        assert!(matches!(r, Err(TransportError::Protocol { .. })), "{r:?}");

        let (_silent, mut server) = pair();
        let r = handshake_as(
            &mut server,
            Role::Acceptor,
            &[1; 32],
            Instant::now() + Duration::from_millis(100),
        );
        assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");

        let (client, mut server) = pair();
        drop(client);
        let r = handshake_as(&mut server, Role::Acceptor, &[1; 32], deadline());
        assert!(matches!(r, Err(TransportError::PeerClosed { .. })), "{r:?}");
    }
}
