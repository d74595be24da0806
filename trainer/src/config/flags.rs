//! Every setting of the training configuration as a flag of `train`, from one definition.
//!
//! The sections of [`TrainConfig`] derive `clap::Args`: a field's doc comment is its flag's
//! help, the section (`#[command(flatten, next_help_heading = "… [section]")]`) its heading, and
//! the flag is the field's name unless its `#[arg(long = …)]` says otherwise. This module adds
//! what the derive cannot: each flag's help names its TOML key, an on/off setting takes
//! `--x`, `--x=false` and `--no-x`, and numbers may be negative (so that the configuration's own
//! check names the setting instead of clap calling `-3` an unknown flag). The flags are applied
//! over the configuration file with `update_from_arg_matches`, which sets only what was given:
//! defaults, then the file, then the flags, as PyTorch Lightning's `LightningCLI` layers them;
//! the flags come from the fields as Hugging Face's `HfArgumentParser` makes them from a
//! dataclass's fields.

use std::path::Path;

use clap::parser::ValueSource;

use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};

use super::TrainConfig;
use crate::TrainError;

/// The id prefix of a `--no-x` flag; the rest of its id is the setting's TOML key.
const NEGATION: &str = "no-setting:";

/// The configuration's flags as given on the command line (`#[command(flatten)]` it last in a
/// command's arguments).
#[derive(Debug, Clone, Default)]
pub struct SettingFlags {
    matches: ArgMatches,
}

impl FromArgMatches for SettingFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(Self {
            matches: matches.clone(),
        })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.matches = matches.clone();
        Ok(())
    }
}

impl Args for SettingFlags {
    fn augment_args(cmd: Command) -> Command {
        augment(cmd)
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        augment(cmd)
    }
}

/// The TOML key of a setting's flag: its heading's `[section]` and the field (an id with a dot
/// is the key itself, for fields whose name another section also has). `None` for a flag
/// outside the configuration.
pub fn setting_key(arg: &Arg) -> Option<String> {
    let heading = arg.get_help_heading()?;
    let section = heading.rsplit_once('[')?.1.strip_suffix(']')?;
    let id = arg.get_id().as_str();
    if id.starts_with(NEGATION) {
        return None;
    }
    Some(if id.contains('.') {
        id.to_string()
    } else {
        format!("{section}.{id}")
    })
}

/// Adds the configuration's flags to `cmd`, each help ending with its TOML key.
fn augment(cmd: Command) -> Command {
    let heading = cmd.get_next_help_heading().map(str::to_string);
    let cmd = TrainConfig::augment_args_for_update(cmd);
    let mut negations = Vec::new();
    let cmd = cmd.mut_args(|arg| {
        let Some(key) = setting_key(&arg) else {
            return arg;
        };
        let mut arg = arg;
        if matches!(arg.get_action(), ArgAction::SetTrue) {
            // On/off: `--x` alone is true, `--x=false` false, and `--no-x` is added; the later
            // of the two wins. Unlike `SetTrue`, nothing is set when neither is given, so the
            // file's value stands.
            let negation = format!("{NEGATION}{key}");
            let long = arg
                .get_long()
                .expect("settings have long flags")
                .to_string();
            negations.push(
                Arg::new(negation.clone())
                    .long(format!("no-{long}"))
                    .action(ArgAction::SetTrue)
                    .help(format!("Sets {key} = false (the opposite of --{long})"))
                    .help_heading(arg.get_help_heading().unwrap_or_default().to_string())
                    .overrides_with(arg.get_id().clone()),
            );
            arg = arg
                .action(ArgAction::Set)
                .value_parser(clap::value_parser!(bool))
                .num_args(0..=1)
                .require_equals(true)
                .default_missing_value("true")
                .value_name("BOOL")
                .overrides_with(negation);
        } else {
            arg = arg.allow_negative_numbers(true);
        }
        let with_key = |help: &clap::builder::StyledStr| format!("{help} [toml: {key}]");
        if let Some(long_help) = arg.get_long_help().map(with_key) {
            arg = arg.long_help(long_help);
        }
        let help = arg
            .get_help()
            .map(with_key)
            .unwrap_or(format!("[toml: {key}]"));
        arg.help(help)
    });
    let cmd = cmd.args(negations);
    match heading {
        Some(heading) => cmd.next_help_heading(heading),
        None => cmd.next_help_heading(None::<&str>),
    }
}

impl SettingFlags {
    /// Whether the flag of field `id` was given on the command line.
    pub fn given(&self, id: &str) -> bool {
        self.matches.try_get_raw(id).is_ok_and(|raw| raw.is_some())
            && self.matches.value_source(id) == Some(ValueSource::CommandLine)
    }

    /// `config` with the flags given applied over it; `origin` names the configuration in
    /// errors. Two flags do a little more than set their field, as `train` always has:
    /// `--seed` also seeds instance creation unless `--instances-seed` is given, and
    /// `--eval-every` or `--eval-interval-samples` replaces the configuration's other cadence.
    ///
    /// # Errors
    /// [`TrainError::Config`] naming `origin`: a value the configuration cannot hold (none for
    /// the derived flags), or a `--no-x` whose setting is missing from the TOML form.
    pub fn apply(&self, config: &mut TrainConfig, origin: &Path) -> Result<(), TrainError> {
        let error = |reason: String| TrainError::Config {
            path: origin.to_path_buf(),
            reason,
        };
        config
            .update_from_arg_matches(&self.matches)
            .map_err(|e| error(format!("applying the command line's settings: {e}")))?;
        let negated: Vec<&str> = self
            .matches
            .ids()
            .filter_map(|id| id.as_str().strip_prefix(NEGATION))
            .filter(|key| self.matches.get_flag(&format!("{NEGATION}{key}")))
            .collect();
        if !negated.is_empty() {
            let mut value = toml::Value::try_from(&*config).map_err(|e| error(e.to_string()))?;
            for key in negated {
                let (path, field) = key.rsplit_once('.').expect("keys have a section");
                let mut table = &mut value;
                for part in path.split('.') {
                    table = table.get_mut(part).ok_or_else(|| {
                        error(format!("no section [{path}] for --no flag of {key}"))
                    })?;
                }
                table
                    .as_table_mut()
                    .ok_or_else(|| error(format!("[{path}] is not a table")))?
                    .insert(field.to_string(), toml::Value::Boolean(false));
            }
            *config = value
                .try_into()
                .map_err(|e: toml::de::Error| error(e.to_string()))?;
        }
        if self.given("seed") && !self.given("instances.seed") {
            config.instances.seed = config.train.seed;
        }
        if self.given("eval_every") {
            config.train.eval_interval_samples = None;
        }
        if self.given("eval_interval_samples") {
            config.train.eval_every = None;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;

    use crate::config::OptimizerKind;

    use super::*;

    fn command() -> Command {
        SettingFlags::augment_args(Command::new("train"))
    }

    /// The file's configuration with `flags` applied, as `train` does.
    fn applied(file: &str, flags: &[&str]) -> TrainConfig {
        let matches = command()
            .try_get_matches_from(std::iter::once("train").chain(flags.iter().copied()))
            .unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        let mut config = TrainConfig::parse(file, Path::new("test.toml")).unwrap();
        SettingFlags::from_arg_matches(&matches)
            .unwrap()
            .apply(&mut config, Path::new("test.toml"))
            .unwrap();
        config
    }

    const FILE: &str = "[optimizer]\nname = \"lamb\"\nlr = 5e-4\nnvlamb = true\n\
                        [optimizer.onebit]\nmask_unused = false\n\
                        [data]\nskip_bad_shards = true\nbin_quota = [4, 4]\n\
                        [train]\nsteps = 7\nprecision = \"fp16\"\n";

    /// Without flags the file stands, on/off settings included (a plain `SetTrue` flag would
    /// have reset them to false).
    #[test]
    fn the_file_stands_where_no_flag_is_given() {
        let file = TrainConfig::parse(FILE, Path::new("test.toml")).unwrap();
        assert_eq!(applied(FILE, &[]), file);
        assert!(file.optimizer.nvlamb && file.data.skip_bad_shards);
        assert!(!file.optimizer.onebit.mask_unused);
    }

    #[test]
    fn flags_set_their_fields_and_nothing_else() {
        let config = applied(
            FILE,
            &[
                "--lr",
                "2e-3",
                "--seq-len",
                "64",
                "--decay-power",
                "2",
                "--bin-quota",
                "1,2,3",
                "--optimizer",
                "onebit-lamb",
                "--onebit-variance",
                "frozen",
                "--nvlamb=false",
                "--onebit-mask-unused",
                "--no-skip-bad-shards",
                "--checkpoint-every",
                "3",
                "--mllog",
                "run.log",
                "--start-warmup-step",
                "-5",
                "--collective-timeout",
                "9.5",
            ],
        );
        let mut expected = TrainConfig::parse(FILE, Path::new("test.toml")).unwrap();
        expected.optimizer.lr = 2e-3;
        expected.instances.max_seq_length = 64;
        expected.schedule.power = 2.0;
        expected.data.bin_quota = Some(vec![1, 2, 3]);
        expected.optimizer.name = OptimizerKind::OnebitLamb;
        expected.optimizer.onebit.variance = Some(crate::onebit::OnebitVariance::Frozen);
        expected.optimizer.nvlamb = false;
        expected.optimizer.onebit.mask_unused = true;
        expected.data.skip_bad_shards = false;
        expected.checkpoint.every = 3;
        expected.mllog.file = Some("run.log".into());
        expected.schedule.start_warmup_step = -5;
        expected.parallel.timeout_s = 9.5;
        assert_eq!(config, expected);
    }

    /// `--x` and `--no-x`: the later one wins.
    #[test]
    fn on_off_flags_take_the_later_one() {
        for (flags, nvlamb) in [
            (&["--no-nvlamb"][..], false),
            (&["--nvlamb", "--no-nvlamb"][..], false),
            (&["--no-nvlamb", "--nvlamb"][..], true),
            (&["--nvlamb=false"][..], false),
            (&["--no-nvlamb", "--nvlamb=true"][..], true),
        ] {
            assert_eq!(applied(FILE, flags).optimizer.nvlamb, nvlamb, "{flags:?}");
        }
        assert!(
            command()
                .try_get_matches_from(["train", "--nvlamb", "maybe"])
                .is_err()
        );
    }

    /// Bad values are the parser's errors naming the flag and the accepted values.
    #[test]
    fn bad_values_name_the_flag() {
        let error = command()
            .try_get_matches_from(["train", "--optimizer", "sgd"])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--optimizer") && error.contains("onebit-lamb"),
            "{error}"
        );
        let error = command()
            .try_get_matches_from(["train", "--steps", "many"])
            .unwrap_err()
            .to_string();
        assert!(error.contains("--steps"), "{error}");
    }

    /// The fields of a section, from serde's "unknown field" message (it lists them all).
    fn fields_of(section: &str) -> Vec<String> {
        let error = TrainConfig::parse(
            &format!("[{section}]\nno_such_field = 1\n"),
            Path::new("probe.toml"),
        )
        .unwrap_err()
        .to_string();
        let list = error
            .split("expected one of ")
            .nth(1)
            .unwrap_or_else(|| panic!("{error}"));
        list.split(',')
            .map(|name| {
                name.trim()
                    .trim_matches(|c| c == '`' || c == '\n')
                    .to_string()
            })
            .filter(|name| !name.is_empty())
            .collect()
    }

    /// One flag per setting: every field of every section has a flag, and every flag's key
    /// is a field (serde would call a wrong key unknown).
    #[test]
    fn every_setting_has_exactly_one_flag() {
        let mut command = command();
        command.build();
        let keys: Vec<String> = command.get_arguments().filter_map(setting_key).collect();
        let unique: BTreeSet<&String> = keys.iter().collect();
        assert_eq!(unique.len(), keys.len(), "a key with two flags: {keys:?}");
        let sections = [
            "model",
            "data",
            "instances",
            "optimizer",
            "optimizer.onebit",
            "schedule",
            "train",
            "parallel",
            "checkpoint",
            "mllog",
            "loss_scale",
        ];
        let mut fields = BTreeSet::new();
        for section in sections {
            for field in fields_of(section) {
                if !sections.contains(&format!("{section}.{field}").as_str()) {
                    fields.insert(format!("{section}.{field}"));
                }
            }
        }
        let keys: BTreeSet<String> = keys.into_iter().collect();
        assert_eq!(keys, fields);
        assert!(fields.len() > 70, "{fields:?}");
    }

    /// `--seed` seeds instance creation too unless `--instances-seed` is given; either cadence
    /// flag replaces the file's other one.
    #[test]
    fn seed_and_cadence_flags_follow_their_rules() {
        let file = "[instances]\nseed = 12345\n[train]\neval_every = 5\n";
        assert_eq!(applied(file, &[]).instances.seed, 12345);
        let seeded = applied(file, &["--seed", "7"]);
        assert_eq!((seeded.train.seed, seeded.instances.seed), (7, 7));
        let both = applied(file, &["--seed", "7", "--instances-seed", "9"]);
        assert_eq!((both.train.seed, both.instances.seed), (7, 9));
        let by_samples = applied(file, &["--eval-interval-samples", "mlperf"]);
        assert_eq!(by_samples.train.eval_every, None);
        assert!(by_samples.train.eval_interval_samples.is_some());
        let by_steps = applied(
            "[train]\neval_interval_samples = 640\n",
            &["--eval-every", "3"],
        );
        assert_eq!(by_steps.train.eval_every, Some(3));
        assert_eq!(by_steps.train.eval_interval_samples, None);
        assert!(
            command()
                .try_get_matches_from([
                    "train",
                    "--eval-every",
                    "2",
                    "--eval-interval-samples",
                    "4"
                ])
                .is_err()
        );
    }

    /// clap's own consistency checks: no id twice, every `overrides_with` and
    /// `conflicts_with` names a flag.
    #[test]
    fn the_flags_pass_clap_s_checks() {
        command().debug_assert();
    }
}
