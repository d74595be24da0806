//! Where a process learns its rank: flags, then torchrun's variables, then OpenMPI's, then
//! Slurm's, else a single process.

use std::fmt;

/// Which source gave the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    /// `--rank` / `--world-size` flags.
    Flags,
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` (torchrun).
    Torchrun,
    /// `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` (mpirun).
    OpenMpi,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` (srun).
    Slurm,
    /// None of the above: one process, rank 0 of 1.
    Single,
}

impl fmt::Display for LaunchSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchSource::Flags => "flags",
            LaunchSource::Torchrun => "torchrun environment",
            LaunchSource::OpenMpi => "OpenMPI environment",
            LaunchSource::Slurm => "Slurm environment",
            LaunchSource::Single => "single process",
        })
    }
}

/// A process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank on this node (selects the GPU).
    pub local_rank: usize,
    /// Rendezvous host for NCCL's unique id (torchrun's `MASTER_ADDR`), if given.
    pub master_addr: Option<String>,
    /// Rendezvous port (`MASTER_PORT`), if given.
    pub master_port: Option<u16>,
    /// Where these values came from.
    pub source: LaunchSource,
}

/// A launch variable that is set but unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("launch variable {name}={value:?}: {reason}")]
pub struct LaunchError {
    /// The variable or flag.
    pub name: String,
    /// Its value.
    pub value: String,
    /// What is wrong.
    pub reason: String,
}

impl LaunchEnv {
    /// The single-process job.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: None,
            master_port: None,
            source: LaunchSource::Single,
        }
    }

    /// Discovers the rank from `flags` (`(rank, world_size)`), else from the environment
    /// through `var` (normally `|k| std::env::var(k).ok()`), in the order torchrun, OpenMPI,
    /// Slurm.
    ///
    /// # Errors
    /// [`LaunchError`] naming the variable: not a number, or a rank outside the world size.
    pub fn discover(
        flags: Option<(usize, usize)>,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, LaunchError> {
        let number = |name: &str| -> Result<Option<usize>, LaunchError> {
            match var(name) {
                None => Ok(None),
                Some(value) => value.trim().parse().map(Some).map_err(|_| LaunchError {
                    name: name.to_string(),
                    value,
                    reason: "not a non-negative integer".into(),
                }),
            }
        };
        let master_addr = var("MASTER_ADDR");
        let master_port = match var("MASTER_PORT") {
            None => None,
            Some(value) => Some(value.trim().parse().map_err(|_| LaunchError {
                name: "MASTER_PORT".into(),
                value,
                reason: "not a port number".into(),
            })?),
        };
        let found = if let Some((rank, world_size)) = flags {
            Some((
                rank,
                world_size,
                number("LOCAL_RANK")?.unwrap_or(rank),
                LaunchSource::Flags,
                "--rank",
            ))
        } else if let (Some(rank), Some(world_size)) = (number("RANK")?, number("WORLD_SIZE")?) {
            Some((
                rank,
                world_size,
                number("LOCAL_RANK")?.unwrap_or(0),
                LaunchSource::Torchrun,
                "RANK",
            ))
        } else if let (Some(rank), Some(world_size)) = (
            number("OMPI_COMM_WORLD_RANK")?,
            number("OMPI_COMM_WORLD_SIZE")?,
        ) {
            let local = number("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0);
            Some((
                rank,
                world_size,
                local,
                LaunchSource::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
            ))
        } else if let (Some(rank), Some(world_size)) =
            (number("SLURM_PROCID")?, number("SLURM_NTASKS")?)
        {
            Some((
                rank,
                world_size,
                number("SLURM_LOCALID")?.unwrap_or(0),
                LaunchSource::Slurm,
                "SLURM_PROCID",
            ))
        } else {
            None
        };
        let Some((rank, world_size, local_rank, source, rank_name)) = found else {
            return Ok(Self::single());
        };
        if world_size == 0 || rank >= world_size {
            return Err(LaunchError {
                name: rank_name.into(),
                value: rank.to_string(),
                reason: format!("must be below the world size {world_size}"),
            });
        }
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            source,
        })
    }

    /// [`LaunchEnv::discover`] with the process environment.
    ///
    /// # Errors
    /// As [`LaunchEnv::discover`].
    pub fn from_env(flags: Option<(usize, usize)>) -> Result<Self, LaunchError> {
        Self::discover(flags, |k| std::env::var(k).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn sources_are_tried_in_order() {
        let all = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "6"),
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
        ]);
        let flags = LaunchEnv::discover(Some((1, 2)), &all).unwrap();
        assert_eq!(
            (flags.rank, flags.world_size, flags.source),
            (1, 2, LaunchSource::Flags)
        );
        let torchrun = LaunchEnv::discover(None, &all).unwrap();
        assert_eq!(
            torchrun,
            LaunchEnv {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                master_addr: Some("node0".into()),
                master_port: Some(29500),
                source: LaunchSource::Torchrun
            }
        );
        let mpi = LaunchEnv::discover(
            None,
            env(&[
                ("OMPI_COMM_WORLD_RANK", "5"),
                ("OMPI_COMM_WORLD_SIZE", "6"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("SLURM_PROCID", "2"),
                ("SLURM_NTASKS", "4"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (mpi.rank, mpi.world_size, mpi.local_rank, mpi.source),
            (5, 6, 1, LaunchSource::OpenMpi)
        );
        let slurm = LaunchEnv::discover(
            None,
            env(&[
                ("SLURM_PROCID", "2"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_LOCALID", "0"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (slurm.rank, slurm.world_size, slurm.source),
            (2, 4, LaunchSource::Slurm)
        );
        assert_eq!(
            LaunchEnv::discover(None, env(&[])).unwrap(),
            LaunchEnv::single()
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e =
            LaunchEnv::discover(None, env(&[("RANK", "two"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert_eq!(e.name, "RANK");
        assert!(e.to_string().contains("RANK=\"two\""), "{e}");
        let e = LaunchEnv::discover(None, env(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert!(e.to_string().contains("below the world size 4"), "{e}");
        let e = LaunchEnv::discover(None, env(&[("MASTER_PORT", "http")])).unwrap_err();
        assert_eq!(e.name, "MASTER_PORT");
    }
}
