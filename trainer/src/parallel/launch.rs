//! Where a process learns its rank: flags, then torchrun's variables, then OpenMPI's, then
//! Slurm's (of a step srun started), else a single process; and which GPU a rank takes.
//!
//! Note [Slurm steps]: `sbatch --ntasks=8` runs the batch script once, with `SLURM_NTASKS=8`
//! and `SLURM_PROCID=0` in its environment; only `srun` starts the 8 tasks of a step, and it
//! alone sets `SLURM_STEP_NUM_TASKS`. So the world size comes from `SLURM_STEP_NUM_TASKS`: a
//! binary run directly in the batch script is one process (and says why in the log), not
//! rank 0 of 8 waiting for peers that never start.

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
    /// `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_LOCALID` (a step started by srun).
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
            LaunchSource::Slurm => "Slurm environment (srun)",
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
    /// Rank on this node (selects the GPU among those the process sees:
    /// [`cuda_device_index`]).
    pub local_rank: usize,
    /// Processes on this node, where the launcher says (torchrun's `LOCAL_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`, Slurm's `SLURM_STEP_TASKS_PER_NODE` at `SLURM_NODEID`).
    pub local_world_size: Option<usize>,
    /// Rendezvous host for NCCL's unique id (torchrun's `MASTER_ADDR`), if given.
    pub master_addr: Option<String>,
    /// Rendezvous port (`MASTER_PORT`), if given.
    pub master_port: Option<u16>,
    /// torchrun's agent serves a c10d `TCPStore` on `MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`): ranks join it as clients (Note [Rendezvous
    /// through the agent's store]).
    pub agent_store: bool,
    /// torchrun's `TORCHELASTIC_RESTART_COUNT` (0 elsewhere): the attempt's keys in its store.
    pub restart_count: u64,
    /// Where these values came from.
    pub source: LaunchSource,
    /// Why a process that looked launched runs alone (Note [Slurm steps]), for the log.
    pub note: Option<String>,
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
            local_world_size: None,
            master_addr: None,
            master_port: None,
            agent_store: false,
            restart_count: 0,
            source: LaunchSource::Single,
            note: None,
        }
    }

    /// Discovers the rank from `flags` (`(rank, world_size)`), else from the environment
    /// through `var` (normally `|k| std::env::var(k).ok()`), in the order torchrun, OpenMPI,
    /// Slurm (Note [Slurm steps]).
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
        let mut note = None;
        let found = if let Some((rank, world_size)) = flags {
            Some((
                rank,
                world_size,
                number("LOCAL_RANK")?.unwrap_or(rank),
                number("LOCAL_WORLD_SIZE")?,
                LaunchSource::Flags,
                "--rank",
            ))
        } else if let (Some(rank), Some(world_size)) = (number("RANK")?, number("WORLD_SIZE")?) {
            Some((
                rank,
                world_size,
                number("LOCAL_RANK")?.unwrap_or(0),
                number("LOCAL_WORLD_SIZE")?,
                LaunchSource::Torchrun,
                "RANK",
            ))
        } else if let (Some(rank), Some(world_size)) = (
            number("OMPI_COMM_WORLD_RANK")?,
            number("OMPI_COMM_WORLD_SIZE")?,
        ) {
            Some((
                rank,
                world_size,
                number("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
                number("OMPI_COMM_WORLD_LOCAL_SIZE")?,
                LaunchSource::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
            ))
        } else if let Some(rank) = number("SLURM_PROCID")? {
            match number("SLURM_STEP_NUM_TASKS")? {
                Some(world_size) => {
                    let local_world_size =
                        match (var("SLURM_STEP_TASKS_PER_NODE"), number("SLURM_NODEID")?) {
                            (Some(spec), Some(node)) => tasks_on_node(&spec, node),
                            _ => None,
                        };
                    Some((
                        rank,
                        world_size,
                        number("SLURM_LOCALID")?.unwrap_or(0),
                        local_world_size,
                        LaunchSource::Slurm,
                        "SLURM_PROCID",
                    ))
                }
                None => {
                    if let Some(tasks) = number("SLURM_NTASKS")?.filter(|&n| n > 1) {
                        note = Some(format!(
                            "SLURM_NTASKS={tasks}, but this process was not started by srun \
                             (SLURM_STEP_NUM_TASKS is unset): it runs as one process; start it \
                             with srun for {tasks} ranks"
                        ));
                    }
                    None
                }
            }
        } else {
            None
        };
        let Some((rank, world_size, local_rank, local_world_size, source, rank_name)) = found
        else {
            return Ok(Self {
                note,
                ..Self::single()
            });
        };
        if world_size == 0 || rank >= world_size {
            return Err(LaunchError {
                name: rank_name.into(),
                value: rank.to_string(),
                reason: format!("must be below the world size {world_size}"),
            });
        }
        let agent_store = source == LaunchSource::Torchrun
            && var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.trim() == "True");
        let restart_count = number("TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0) as u64;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            agent_store,
            restart_count,
            source,
            note,
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

/// The tasks on node `node` of a Slurm tasks-per-node spec: `2(x3),1` is 2, 2, 2, 1.
fn tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut seen = 0;
    for part in spec.trim().split(',') {
        let (tasks, repeat) = match part.split_once("(x") {
            Some((tasks, repeat)) => (tasks, repeat.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part, 1),
        };
        let tasks = tasks.parse::<usize>().ok()?;
        if node < seen + repeat {
            return Some(tasks);
        }
        seen += repeat;
    }
    None
}

/// The CUDA device a rank takes among the `visible` GPUs its process sees (after
/// `CUDA_VISIBLE_DEVICES`): with one visible GPU, that one (Slurm's `--gpus-per-task=1`, or a
/// launcher that gives each rank its own `CUDA_VISIBLE_DEVICES`); with several, the one at
/// its local rank (torchrun, mpirun, srun on a node's GPUs), as PyTorch's
/// `torch.cuda.set_device(LOCAL_RANK)`. `local_world_size` is the launcher's count of ranks
/// on the node, when known.
///
/// # Errors
/// A message naming what was seen: no visible GPU, a local rank past the visible GPUs, or
/// several local ranks that all see the same one GPU (`CUDA_VISIBLE_DEVICES` unset: no
/// launcher gave each rank its own).
pub fn cuda_device_index(
    local_rank: usize,
    local_world_size: Option<usize>,
    visible: usize,
    cuda_visible_devices: Option<&str>,
) -> Result<usize, String> {
    let shown = match cuda_visible_devices {
        Some(v) => format!("CUDA_VISIBLE_DEVICES={v:?}"),
        None => "CUDA_VISIBLE_DEVICES unset".into(),
    };
    match visible {
        0 => Err(format!(
            "the NVIDIA driver sees no GPU ({shown}): check nvidia-smi, and the GPUs the \
             launcher gives this process"
        )),
        1 if cuda_visible_devices.is_none() && local_world_size.is_some_and(|n| n > 1) => {
            Err(format!(
                "{} ranks on this node, and every one sees the same one GPU ({shown}): start \
                 one rank per GPU, or give each rank its own (CUDA_VISIBLE_DEVICES, Slurm's \
                 --gpus-per-task=1)",
                local_world_size.unwrap_or(1)
            ))
        }
        1 => Ok(0),
        n if local_rank < n => Ok(local_rank),
        n => Err(format!(
            "local rank {local_rank}, but this process sees {n} GPUs ({shown}): start at most \
             {n} ranks per node, or give each rank one GPU (Slurm: --gpus-per-task=1)"
        )),
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
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "6"),
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NUM_TASKS", "4"),
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
                local_world_size: Some(4),
                master_addr: Some("node0".into()),
                master_port: Some(29500),
                agent_store: false,
                restart_count: 0,
                source: LaunchSource::Torchrun,
                note: None,
            }
        );
        let mpi = LaunchEnv::discover(
            None,
            env(&[
                ("OMPI_COMM_WORLD_RANK", "5"),
                ("OMPI_COMM_WORLD_SIZE", "6"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
                ("SLURM_PROCID", "2"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_STEP_NUM_TASKS", "4"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (
                mpi.rank,
                mpi.world_size,
                mpi.local_rank,
                mpi.local_world_size,
                mpi.source
            ),
            (5, 6, 1, Some(2), LaunchSource::OpenMpi)
        );
        assert_eq!(
            LaunchEnv::discover(None, env(&[])).unwrap(),
            LaunchEnv::single()
        );
    }

    /// torchrun 2.5+ serves its own c10d store on MASTER_PORT and says so; an attempt after a
    /// restart has its own keys.
    #[test]
    fn torchrun_agent_store_and_restart_count() {
        let launch = LaunchEnv::discover(
            None,
            env(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                ("TORCHELASTIC_RESTART_COUNT", "3"),
            ]),
        )
        .unwrap();
        assert!(launch.agent_store);
        assert_eq!(launch.restart_count, 3);
        // PyTorch compares with the string "True" exactly; torchrun without its store.
        for value in ["False", "true", "1"] {
            let launch = LaunchEnv::discover(
                None,
                env(&[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("TORCHELASTIC_USE_AGENT_STORE", value),
                ]),
            )
            .unwrap();
            assert!(!launch.agent_store, "{value}");
        }
    }

    /// Note [Slurm steps]: srun's step variables make a rank; a batch script's allocation
    /// alone does not.
    #[test]
    fn slurm_ranks_come_from_srun_steps_only() {
        let step = LaunchEnv::discover(
            None,
            env(&[
                ("SLURM_PROCID", "5"),
                ("SLURM_NTASKS", "16"),
                ("SLURM_STEP_NUM_TASKS", "8"),
                ("SLURM_LOCALID", "1"),
                ("SLURM_NODEID", "1"),
                ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (
                step.rank,
                step.world_size,
                step.local_rank,
                step.local_world_size,
                step.source
            ),
            (5, 8, 1, Some(4), LaunchSource::Slurm)
        );
        // sbatch --ntasks=4 running the binary directly: one process, and the log says why.
        let batch = LaunchEnv::discover(
            None,
            env(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_LOCALID", "0"),
            ]),
        )
        .unwrap();
        assert_eq!((batch.rank, batch.world_size), (0, 1));
        assert_eq!(batch.source, LaunchSource::Single);
        let note = batch.note.unwrap();
        assert!(
            note.contains("SLURM_NTASKS=4") && note.contains("srun"),
            "{note}"
        );
        // A one-task allocation is a plain single process, without a note.
        let one = LaunchEnv::discover(None, env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]))
            .unwrap();
        assert_eq!(one, LaunchEnv::single());
        assert_eq!(tasks_on_node("2(x3),1", 0), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
        assert_eq!(tasks_on_node("x", 0), None);
    }

    /// The GPU a rank takes: its local rank among several visible GPUs, the only one when
    /// the launcher gave it one (Slurm --gpus-per-task=1: every task sees its own GPU as 0).
    #[test]
    fn device_index_over_the_environments() {
        // torchrun --nproc-per-node 8 on an 8-GPU node.
        assert_eq!(cuda_device_index(5, Some(8), 8, None), Ok(5));
        // srun --gpus-per-task=1: SLURM_LOCALID 3 of 8, one GPU visible.
        assert_eq!(cuda_device_index(3, Some(8), 1, Some("3")), Ok(0));
        // CUDA_VISIBLE_DEVICES=2,3 for two local ranks.
        assert_eq!(cuda_device_index(1, Some(2), 2, Some("2,3")), Ok(1));
        // One process on a one-GPU machine.
        assert_eq!(cuda_device_index(0, None, 1, None), Ok(0));
        let e = cuda_device_index(4, Some(8), 2, Some("0,1")).unwrap_err();
        assert!(
            e.contains("local rank 4") && e.contains("2 GPUs") && e.contains("\"0,1\""),
            "{e}"
        );
        let e = cuda_device_index(0, Some(1), 0, Some("")).unwrap_err();
        assert!(
            e.contains("no GPU") && e.contains("CUDA_VISIBLE_DEVICES"),
            "{e}"
        );
        // torchrun --nproc-per-node 2 on a one-GPU machine: both ranks would take GPU 0.
        let e = cuda_device_index(1, Some(2), 1, None).unwrap_err();
        assert!(
            e.contains("2 ranks on this node") && e.contains("same one GPU"),
            "{e}"
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
        let e = LaunchEnv::discover(
            None,
            env(&[("SLURM_PROCID", "1"), ("SLURM_STEP_NUM_TASKS", "many")]),
        )
        .unwrap_err();
        assert_eq!(e.name, "SLURM_STEP_NUM_TASKS");
    }
}
