//! What `Communicator::from_env` reads: rank and size from whichever launcher started this
//! process, where the root is, and the job secret.
//!
//! Rank/size, first match wins:
//!   `ciera launch`   CIERA_RANK / CIERA_NRANKS (+ CIERA_LOCAL_RANK / CIERA_LOCAL_NRANKS)
//!   Open MPI         OMPI_COMM_WORLD_RANK / _SIZE (+ OMPI_COMM_WORLD_LOCAL_RANK / _SIZE)
//!   MPICH, Intel MPI PMI_RANK / PMI_SIZE (+ MPI_LOCALRANKID / MPI_LOCALNRANKS)
//!   Slurm srun       SLURM_PROCID / SLURM_NTASKS (+ SLURM_LOCALID; one node if SLURM_NNODES=1)
//!   torchrun         RANK / WORLD_SIZE (+ LOCAL_RANK / LOCAL_WORLD_SIZE)
//!   none of these    a single rank.
//!
//! Root and secret:
//! - CIERA_ROOT=host:port (set by `ciera launch`, or by hand for multi-host jobs) with
//!   CIERA_SECRET (64 hex digits) on every rank. Rank 0 serves the root on that address and
//!   port (`bootstrap::bind_root`: only there, not on every interface) unless
//!   CIERA_ROOT_SERVED=1 says someone else does (`ciera launch` serves it itself).
//! - MASTER_ADDR / MASTER_PORT (torchrun) with CIERA_SECRET: rank 0 serves the root on
//!   CIERA_PORT, or MASTER_PORT+1 (MASTER_PORT itself is torch's store).
//! - No CIERA_ROOT and no CIERA_SECRET (or no MASTER_ADDR), all ranks on one host (the
//!   launcher's local size equals the world size): rank 0 makes a UniqueId and publishes it in a
//!   0600 file, `/dev/shm/ciera-<job>-<parent pid>.id` (or under $TMPDIR), named from the
//!   launcher's job id and the launcher's pid; the other ranks wait for that file, check it
//!   belongs to their user and is private, and join. Rank 0 deletes it once all have joined.
//! - Otherwise (several hosts and no root address or no secret): an error saying what to set.

use std::fs;
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::time::Instant;

use super::id::{parse_hex_secret, UniqueId, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};

/// Rank, size and job identity as a launcher gave them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Which launcher: "ciera", "openmpi", "pmi", "slurm", "torchrun" or "none".
    pub launcher: &'static str,
    pub rank: usize,
    pub nranks: usize,
    pub local_rank: Option<usize>,
    pub local_nranks: Option<usize>,
    /// Whether every rank is known to be on this host.
    pub single_host: bool,
    /// A name for this job, unique on this host while it runs.
    pub job_key: String,
}

/// Look up `name` in the environment (a function, so tests can pass a map).
pub type Getenv<'a> = dyn Fn(&str) -> Option<String> + 'a;

pub fn real_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn num(get: &Getenv<'_>, name: &str) -> Result<Option<usize>> {
    match get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer"))
        }),
    }
}

impl LaunchEnv {
    pub fn detect(get: &Getenv<'_>) -> Result<LaunchEnv> {
        // (launcher, rank var, size var, local rank var, local size var)
        const LAUNCHERS: [(&str, &str, &str, &str, &str); 5] = [
            (
                "ciera",
                "CIERA_RANK",
                "CIERA_NRANKS",
                "CIERA_LOCAL_RANK",
                "CIERA_LOCAL_NRANKS",
            ),
            (
                "openmpi",
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
            (
                "pmi",
                "PMI_RANK",
                "PMI_SIZE",
                "MPI_LOCALRANKID",
                "MPI_LOCALNRANKS",
            ),
            ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""),
            (
                "torchrun",
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
            ),
        ];
        let ppid = std::os::unix::process::parent_id();
        for (launcher, rank_var, size_var, lrank_var, lsize_var) in LAUNCHERS {
            let (Some(rank), Some(nranks)) = (num(get, rank_var)?, num(get, size_var)?) else {
                continue;
            };
            if nranks == 0 || rank >= nranks {
                return Err(Error::InvalidArgument(format!(
                    "{rank_var}={rank} is out of range for {size_var}={nranks}"
                )));
            }
            let local_rank = num(get, lrank_var)?;
            let mut local_nranks = if lsize_var.is_empty() {
                None
            } else {
                num(get, lsize_var)?
            };
            if launcher == "slurm" && num(get, "SLURM_NNODES")? == Some(1) {
                local_nranks = Some(nranks);
            }
            let job = match launcher {
                "openmpi" => get("PMIX_NAMESPACE").or_else(|| get("OMPI_MCA_ess_base_jobid")),
                "pmi" => get("PMI_KVSNAME").or_else(|| get("PMI_ID")),
                "slurm" => get("SLURM_JOB_ID")
                    .map(|j| format!("{j}.{}", get("SLURM_STEP_ID").unwrap_or_default())),
                "torchrun" => Some(format!(
                    "{}-{}",
                    get("TORCHELASTIC_RUN_ID").unwrap_or_default(),
                    get("MASTER_PORT").unwrap_or_default()
                )),
                _ => None,
            };
            // Ranks on one host started by one launcher share its pid as their parent.
            let job_key = sanitize(&format!("{launcher}-{}-{ppid}", job.unwrap_or_default()));
            return Ok(LaunchEnv {
                launcher,
                rank,
                nranks,
                local_rank,
                local_nranks,
                single_host: nranks == 1 || local_nranks == Some(nranks),
                job_key,
            });
        }
        Ok(LaunchEnv {
            launcher: "none",
            rank: 0,
            nranks: 1,
            local_rank: Some(0),
            local_nranks: Some(1),
            single_host: true,
            job_key: format!("none-{}", std::process::id()),
        })
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// How this rank reaches the root.
pub enum Rendezvous {
    /// Connect to `addr` (resolved when joining) with `secret`; if `serve` is set, this
    /// process (rank 0) first starts the root server listening on that port.
    Address {
        addr: String,
        secret: [u8; 32],
        serve_port: Option<u16>,
    },
    /// Single host, no secret given: the UniqueId file.
    File {
        path: PathBuf,
        secret: Option<[u8; 32]>,
    },
}

pub fn rendezvous(get: &Getenv<'_>, env: &LaunchEnv) -> Result<Rendezvous> {
    let secret = get("CIERA_SECRET")
        .map(|s| parse_hex_secret(&s))
        .transpose()?;
    if let Some(root) = get("CIERA_ROOT") {
        let Some(secret) = secret else {
            return Err(Error::Bootstrap(
                "CIERA_ROOT is set but CIERA_SECRET is not: every rank needs the job secret \
                 (64 hex digits, e.g. from `openssl rand -hex 32`); `ciera launch` sets both"
                    .into(),
            ));
        };
        let served = get("CIERA_ROOT_SERVED").as_deref() == Some("1");
        let serve_port = if env.rank == 0 && !served {
            Some(port_of(&root, "CIERA_ROOT")?)
        } else {
            None
        };
        return Ok(Rendezvous::Address {
            addr: root,
            secret,
            serve_port,
        });
    }
    if let (Some(master), Some(mport), Some(secret)) =
        (get("MASTER_ADDR"), get("MASTER_PORT"), secret)
    {
        let port = match get("CIERA_PORT") {
            Some(p) => p.parse::<u16>().map_err(|_| {
                Error::InvalidArgument(format!("CIERA_PORT={p:?} is not a port number"))
            })?,
            None => mport
                .parse::<u16>()
                .ok()
                .and_then(|p| p.checked_add(1))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "MASTER_PORT={mport:?} is not a port number below 65535"
                    ))
                })?,
        };
        let addr = if master.contains(':') && !master.starts_with('[') {
            format!("[{master}]:{port}")
        } else {
            format!("{master}:{port}")
        };
        return Ok(Rendezvous::Address {
            addr,
            secret,
            serve_port: (env.rank == 0).then_some(port),
        });
    }
    if env.single_host {
        let dir = if fs::metadata("/dev/shm")
            .map(|m| m.is_dir())
            .unwrap_or(false)
        {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        return Ok(Rendezvous::File {
            path: dir.join(format!("ciera-{}.id", env.job_key)),
            secret,
        });
    }
    Err(Error::Bootstrap(format!(
        "{} ranks launched by {} may span several hosts, and no root address is set: set \
         CIERA_ROOT=host:port (rank 0's host, a free port) and CIERA_SECRET (64 hex digits, the \
         same on every rank), or MASTER_ADDR/MASTER_PORT with CIERA_SECRET",
        env.nranks, env.launcher
    )))
}

fn port_of(addr: &str, var: &str) -> Result<u16> {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| Error::InvalidArgument(format!("{var}={addr:?} is not host:port")))
}

pub fn resolve(addr: &str) -> Result<Vec<SocketAddr>> {
    addr.to_socket_addrs()
        .map(|a| a.collect())
        .map_err(|e| Error::Bootstrap(format!("resolving the root address {addr:?}: {e}")))
}

/// Rank 0: publish `id` at `path`, readable by this user only. Written to a temporary name and
/// renamed, so readers never see half a file.
pub fn publish_id(path: &PathBuf, id: &UniqueId) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let io = |e: std::io::Error| Error::Io {
        what: format!("writing the rendezvous file {}", tmp.display()),
        source: e,
    };
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(id.as_bytes()).map_err(io)?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| Error::Io {
        what: format!("renaming the rendezvous file to {}", path.display()),
        source: e,
    })
}

/// Other ranks: the id at `path`, if it is there yet. Refuses a file that is not this user's
/// or that others can read (someone else's file must not steer us to their root).
pub fn read_id(path: &PathBuf) -> Result<Option<UniqueId>> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::Io {
                what: format!("rendezvous file {}", path.display()),
                source: e,
            })
        }
    };
    let my_uid = fs::metadata("/proc/self").map(|m| m.uid()).ok();
    if my_uid.is_some_and(|u| u != meta.uid()) || meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::Bootstrap(format!(
            "rendezvous file {} belongs to uid {} with mode {:o}; refusing it (expected this \
             user's, mode 600)",
            path.display(),
            meta.uid(),
            meta.permissions().mode() & 0o777
        )));
    }
    let b = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::Io {
                what: format!("reading {}", path.display()),
                source: e,
            })
        }
    };
    let Ok(arr) = <[u8; UNIQUE_ID_BYTES]>::try_from(b.as_slice()) else {
        return Ok(None); // being replaced; look again
    };
    UniqueId::from_bytes(&arr).map(Some)
}

/// Poll for the id file until `deadline`.
pub fn wait_for_id(path: &PathBuf, deadline: Instant) -> Result<UniqueId> {
    loop {
        if let Some(id) = read_id(path)? {
            return Ok(id);
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                op: format!(
                    "bootstrap: waiting for rank 0 to publish {}",
                    path.display()
                ),
                peer: Some(0),
                after: std::time::Duration::ZERO,
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn detect(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let m = env_of(pairs);
        LaunchEnv::detect(&|k| m.get(k).cloned())
    }

    #[test]
    fn launchers_are_recognised_in_order() {
        let e = detect(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("PMIX_NAMESPACE", "prterun-x-1@1"),
        ])
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.nranks, e.single_host),
            ("openmpi", 2, 4, true)
        );
        assert!(
            e.job_key.starts_with("openmpi-prterun-x-1_1-"),
            "{}",
            e.job_key
        );
        let e = detect(&[
            ("CIERA_RANK", "1"),
            ("CIERA_NRANKS", "3"),
            ("RANK", "0"),
            ("WORLD_SIZE", "9"),
        ])
        .unwrap();
        assert_eq!((e.launcher, e.rank, e.nranks), ("ciera", 1, 3));
        let e = detect(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_NNODES", "2"),
        ])
        .unwrap();
        assert_eq!((e.launcher, e.single_host), ("slurm", false));
        let e = detect(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!((e.launcher, e.single_host), ("torchrun", true));
        let e = detect(&[]).unwrap();
        assert_eq!((e.launcher, e.rank, e.nranks), ("none", 0, 1));
        assert!(detect(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")]).is_err());
        assert!(detect(&[("PMI_RANK", "x"), ("PMI_SIZE", "4")]).is_err());
    }

    #[test]
    fn rendezvous_rules() {
        let secret = "ab".repeat(32);
        let m = env_of(&[("CIERA_ROOT", "127.0.0.1:5000"), ("CIERA_SECRET", &secret)]);
        let get = |k: &str| m.get(k).cloned();
        let e = LaunchEnv {
            launcher: "ciera",
            rank: 0,
            nranks: 2,
            local_rank: None,
            local_nranks: None,
            single_host: false,
            job_key: "k".into(),
        };
        match rendezvous(&get, &e).unwrap() {
            Rendezvous::Address { serve_port, .. } => assert_eq!(serve_port, Some(5000)),
            _ => panic!("expected an address"),
        }
        // Root without secret: refused with a hint.
        let m2 = env_of(&[("CIERA_ROOT", "127.0.0.1:5000")]);
        let err = rendezvous(&|k: &str| m2.get(k).cloned(), &e)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("CIERA_SECRET"), "{err}");
        // torchrun: MASTER_PORT + 1.
        let m3 = env_of(&[
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "29500"),
            ("CIERA_SECRET", &secret),
        ]);
        match rendezvous(&|k: &str| m3.get(k).cloned(), &e).unwrap() {
            Rendezvous::Address {
                addr, serve_port, ..
            } => {
                assert_eq!(addr, "node1:29501");
                assert_eq!(serve_port, Some(29501));
            }
            _ => panic!("expected an address"),
        }
        // Multi-host and nothing set: a clear error.
        let none = HashMap::<String, String>::new();
        let err = rendezvous(&|k: &str| none.get(k).cloned(), &e)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("CIERA_ROOT"), "{err}");
        // Single host: the file.
        let single = LaunchEnv {
            single_host: true,
            ..e
        };
        assert!(matches!(
            rendezvous(&|k: &str| none.get(k).cloned(), &single).unwrap(),
            Rendezvous::File { .. }
        ));
    }

    #[test]
    fn id_file_is_private_and_checked() {
        let dir = std::env::temp_dir().join(format!("ciera-env-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("job.id");
        assert!(read_id(&path).unwrap().is_none());
        let id = UniqueId::from_parts("127.0.0.1:1".parse().unwrap(), &[3; 32]);
        publish_id(&path, &id).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(read_id(&path).unwrap().unwrap(), id);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_id(&path).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}
