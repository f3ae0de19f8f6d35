//! The configuration file of `idemq run` and `idemq config check`: TOML
//! holding what `consume` and `relay` invocations take, for one process to
//! run them all.
//!
//! ```toml
//! store = "postgres://app@db/orders"    # --store, for every job
//! table-prefix = "idemq_"               # --table-prefix
//! http-addr = "127.0.0.1:9464"          # one /metrics, /healthz, /readyz
//!
//! [[consumer]]                           # an `idemq consume`
//! consumer = "billing"                   # its name (required)
//! source = "kafka://k:9092/payments?group=billing"
//! key = "json:/payment_id"
//! apply-sql = "INSERT INTO ledger VALUES (:idemq_key, :amount)"
//! concurrency = 16
//!
//! [[relay]]                              # an `idemq relay`
//! to = "kafka://k:9092/events"
//! ```
//!
//! Every other key of a job is the long flag of that command, as written on
//! the command line (`apply-sql` or `apply_sql`): a string or number is its
//! value, `true` sets a switch, an array repeats the flag. Each job is parsed
//! by the same argument definitions as the command, so it is validated and
//! defaulted exactly as the command would be.
//!
//! Precedence for the process-wide `store` and `table-prefix`: a flag given
//! to `idemq run` wins, then the environment (`IDEMQ_STORE`,
//! `IDEMQ_TABLE_PREFIX`), then the job's own key, then the file's top-level
//! key, then the default. A consumer's name is its identity in the inbox:
//! always the file's, whatever `IDEMQ_CONSUMER` says.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context, Result};
use clap::Parser;

use crate::{exit, Cli};

/// What the file asks one process to run.
#[derive(Debug)]
pub struct Plan {
    /// The process's `/metrics`, `/healthz`, `/readyz` address.
    pub http_addr: Option<SocketAddr>,
    /// The jobs, in file order.
    pub jobs: Vec<Job>,
}

/// One `consume` or `relay` of the file, parsed.
#[derive(Debug)]
pub struct Job {
    /// `consumer billing`, `relay 1`: for messages and check names.
    pub label: String,
    /// The command line the job stands for, for `config check`.
    pub argv: Vec<String>,
    /// Where the effective store came from: `flag`, `environment`, `file`, `default`.
    pub store_from: &'static str,
    /// The parsed invocation.
    pub cli: Cli,
}

/// What `idemq run` was given on its own command line.
#[derive(Debug, Default)]
pub struct Overrides {
    /// `--store`, when given as a flag.
    pub store: Option<String>,
    /// `--table-prefix`, when given as a flag.
    pub table_prefix: Option<String>,
}

const TOP_LEVEL: [&str; 5] = ["store", "table-prefix", "http-addr", "consumer", "relay"];

/// Reads and checks `path`: every job parsed as its command would be.
pub fn load(path: &Path, overrides: &Overrides) -> Result<Plan> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {}", path.display()))
        .map_err(|e| exit::usage(format!("{e:#}")))?;
    parse(&text, overrides).map_err(|e| exit::usage(format!("{}: {e}", path.display())))
}

/// [`load`] of a file's text; errors name the job and the key, never a value.
fn parse(text: &str, overrides: &Overrides) -> Result<Plan, String> {
    let file: toml::Table = toml::from_str(text).map_err(|e| format!("not valid TOML: {e}"))?;
    let file: toml::Table = file.into_iter().map(|(k, v)| (flag_name(&k), v)).collect();
    if let Some(unknown) = file.keys().find(|k| !TOP_LEVEL.contains(&k.as_str())) {
        return Err(format!(
            "unknown top-level key {unknown:?} (expected {})",
            TOP_LEVEL.join(", ")
        ));
    }
    let http_addr = match file.get("http-addr") {
        None => None,
        Some(toml::Value::String(addr)) => Some(
            addr.parse()
                .map_err(|e| format!("http-addr {addr:?}: {e}"))?,
        ),
        Some(_) => return Err("http-addr must be a string such as \"127.0.0.1:9464\"".into()),
    };
    let mut jobs = Vec::new();
    let mut names = BTreeSet::new();
    for (kind, command) in [("consumer", "consume"), ("relay", "relay")] {
        let tables = match file.get(kind) {
            None => continue,
            Some(toml::Value::Array(tables)) => tables,
            Some(_) => return Err(format!("{kind} must be an array of tables: [[{kind}]]")),
        };
        for (n, table) in tables.iter().enumerate() {
            let toml::Value::Table(table) = table else {
                return Err(format!("{kind} must be an array of tables: [[{kind}]]"));
            };
            let table: toml::Table = table
                .iter()
                .map(|(k, v)| (flag_name(k), v.clone()))
                .collect();
            let label = match (kind, table.get("consumer")) {
                ("consumer", Some(toml::Value::String(name))) => {
                    if !names.insert(name.clone()) {
                        return Err(format!("consumer {name:?} is named twice"));
                    }
                    format!("consumer {name}")
                }
                ("consumer", _) => {
                    return Err(format!(
                        "consumer #{}: `consumer = \"NAME\"` is required",
                        n + 1
                    ))
                }
                _ => format!("relay {}", n + 1),
            };
            let job = job(&file, &table, command, &label, overrides)
                .map_err(|e| format!("{label}: {e}"))?;
            jobs.push(job);
        }
    }
    if jobs.is_empty() {
        return Err("no [[consumer]] and no [[relay]]: nothing to run".into());
    }
    Ok(Plan { http_addr, jobs })
}

/// `apply_sql` → `apply-sql`: keys are written as flags are, or with `_`.
fn flag_name(key: &str) -> String {
    key.replace('_', "-")
}

/// One job's command line, parsed by the command's own definitions.
fn job(
    file: &toml::Table,
    table: &toml::Table,
    command: &str,
    label: &str,
    overrides: &Overrides,
) -> Result<Job, String> {
    if table.contains_key("http-addr") {
        return Err("set http-addr at the top of the file: the process serves one endpoint".into());
    }
    let mut argv = vec!["idemq".to_owned()];
    let mut store_from = "default";
    for (key, flag, env, given) in [
        ("store", "--store", "IDEMQ_STORE", &overrides.store),
        (
            "table-prefix",
            "--table-prefix",
            "IDEMQ_TABLE_PREFIX",
            &overrides.table_prefix,
        ),
    ] {
        let from_file = table.get(key).or_else(|| file.get(key));
        let (value, from) = match (given, std::env::var_os(env), from_file) {
            (Some(value), _, _) => (Some(value.clone()), "flag"),
            // Left to the argument parser, which reads the environment.
            (None, Some(_), _) => (None, "environment"),
            (None, None, Some(toml::Value::String(value))) => (Some(value.clone()), "file"),
            (None, None, Some(_)) => return Err(format!("{key} must be a string")),
            (None, None, None) => (None, "default"),
        };
        if let Some(value) = value {
            argv.push(flag.to_owned());
            argv.push(value);
        }
        if key == "store" {
            store_from = from;
        }
    }
    argv.push(command.to_owned());
    for (key, value) in table {
        if key == "store" || key == "table-prefix" {
            continue;
        }
        if command == "consume" && key == "source" {
            match value {
                toml::Value::String(source) => argv.push(source.clone()),
                _ => return Err("source must be a string".into()),
            }
            continue;
        }
        let flag = format!("--{key}");
        match value {
            toml::Value::Boolean(true) => argv.push(flag),
            toml::Value::Boolean(false) => {}
            toml::Value::Array(values) => {
                for value in values {
                    argv.push(flag.clone());
                    argv.push(scalar(key, value)?);
                }
            }
            value => {
                argv.push(flag);
                argv.push(scalar(key, value)?);
            }
        }
    }
    if command == "consume" && !table.contains_key("source") {
        return Err("`source = \"…\"` is required (a file, `-` or a broker URL)".into());
    }
    let cli = Cli::try_parse_from(&argv).map_err(|e| describe(&e))?;
    cli.command.validate().map_err(|e| format!("{e:#}"))?;
    Ok(Job {
        label: label.to_owned(),
        argv,
        store_from,
        cli,
    })
}

/// A TOML string or number as a flag's value.
fn scalar(key: &str, value: &toml::Value) -> Result<String, String> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(n) => Ok(n.to_string()),
        toml::Value::Float(x) => Ok(x.to_string()),
        _ => Err(format!("{key}: expected a string, a number or true")),
    }
}

/// A parse error of a job, naming the key but never echoing its value (it
/// may hold a password).
fn describe(error: &clap::Error) -> String {
    use clap::error::{ContextKind, ErrorKind};
    let arg = error
        .get(ContextKind::InvalidArg)
        .map(|arg| arg.to_string())
        .unwrap_or_default();
    let key = arg
        .trim_start_matches("--")
        .split(['=', ' ', '<'])
        .next()
        .unwrap_or_default()
        .to_owned();
    let why = std::error::Error::source(error)
        .map(|source| format!(": {source}"))
        .unwrap_or_default();
    match error.kind() {
        ErrorKind::UnknownArgument => format!("unknown key {key:?}"),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation => {
            format!("invalid value for {key:?}{why}")
        }
        ErrorKind::MissingRequiredArgument => format!(
            "missing {}",
            error
                .get(ContextKind::InvalidArg)
                .map(|arg| arg.to_string())
                .unwrap_or_else(|| "a required key".into())
        ),
        ErrorKind::ArgumentConflict => format!("conflicting keys ({arg})"),
        ErrorKind::TooManyValues | ErrorKind::WrongNumberOfValues => {
            format!("too many values for {key:?}")
        }
        kind => format!("{kind}{why}"),
    }
}

/// The consumers of the file at `path`: each one's name and source.
pub fn consumers(
    path: &Path,
    overrides: &Overrides,
) -> Result<Vec<(String, crate::endpoint::Endpoint)>> {
    let plan = load(path, overrides)?;
    Ok(plan
        .jobs
        .into_iter()
        .filter_map(|job| match job.cli.command {
            crate::Command::Consume(consume) => Some((consume.consumer, consume.input)),
            _ => None,
        })
        .collect())
}

/// The store and table prefix the consumers of the file at `path` share
/// (the file's, or the flag's or environment's that override it), if they
/// share one: the console and `idemq doctor` read that store rather than
/// `--store`'s default.
pub fn shared_store(path: &Path, overrides: &Overrides) -> Result<Option<(String, String)>> {
    let plan = load(path, overrides)?;
    let mut stores = plan
        .jobs
        .iter()
        .filter(|job| matches!(job.cli.command, crate::Command::Consume(_)))
        .map(|job| {
            (
                job.cli.global.store.clone(),
                job.cli.global.table_prefix.clone(),
            )
        });
    let Some(first) = stores.next() else {
        return Ok(None);
    };
    Ok(stores.all(|other| other == first).then_some(first))
}

/// `config check`'s view of a job: its command line, with URLs and
/// header values redacted.
pub fn redacted_argv(argv: &[String]) -> String {
    let mut shown = Vec::with_capacity(argv.len());
    let mut after_header = false;
    for word in argv {
        let word = if after_header {
            match word.split_once(':') {
                Some((name, _)) => format!("{name}: ***"),
                None => "***".to_owned(),
            }
        } else {
            idemq::redact::redact_url(word)
        };
        after_header = word == "--http-header";
        shown.push(crate::output::shell_word(&word));
    }
    shown.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Command;

    fn plan(text: &str) -> Result<Plan, String> {
        parse(text, &Overrides::default())
    }

    #[test]
    fn keys_become_the_commands_flags() {
        let plan = plan(
            r#"
            store = "sqlite://file.db"
            http_addr = "127.0.0.1:9464"
            [[consumer]]
            consumer = "billing"
            source = "in.jsonl"
            key = "json:/id"
            print = true
            concurrency = 4
            [[consumer]]
            consumer = "audit"
            source = "-"
            store = "sqlite://audit.db"
            print = true
            [[relay]]
            to = "out.jsonl"
            destination = ["a", "b"]
            "#,
        )
        .unwrap();
        assert_eq!(plan.http_addr, Some("127.0.0.1:9464".parse().unwrap()));
        let labels: Vec<&str> = plan.jobs.iter().map(|j| j.label.as_str()).collect();
        assert_eq!(labels, ["consumer billing", "consumer audit", "relay 1"]);
        assert_eq!(plan.jobs[1].cli.global.store, "sqlite://audit.db");
        let Command::Consume(billing) = &plan.jobs[0].cli.command else {
            panic!("a consume");
        };
        assert_eq!(billing.concurrency, 4);
        assert_eq!(billing.consumer, "billing");
        let Command::Relay(relay) = &plan.jobs[2].cli.command else {
            panic!("a relay");
        };
        assert_eq!(relay.destinations, ["a", "b"]);
    }

    #[test]
    fn mistakes_name_the_job_and_the_key_but_not_the_value() {
        let cases = [
            ("[[consumer]]\nsource = \"-\"\nprint = true", "`consumer = \"NAME\"` is required"),
            (
                "[[consumer]]\nconsumer = \"a\"\nsource = \"-\"\nprint = true\nbogus = 1",
                "consumer a: unknown key \"bogus\"",
            ),
            (
                "[[consumer]]\nconsumer = \"a\"\nsource = \"-\"\nprint = true\nconcurrency = \"pw-s3cret\"",
                "consumer a: invalid value for \"concurrency\"",
            ),
            (
                "[[consumer]]\nconsumer = \"a\"\nsource = \"-\"\nprint = true\nhttp-addr = \"x\"",
                "set http-addr at the top",
            ),
            ("[[consumer]]\nconsumer = \"a\"\nprint = true", "`source = \"…\"` is required"),
            ("stor = 1", "unknown top-level key \"stor\""),
            ("", "nothing to run"),
            (
                "[[consumer]]\nconsumer = \"a\"\nsource = \"-\"\nprint = true\n\
                 [[consumer]]\nconsumer = \"a\"\nsource = \"-\"\nprint = true",
                "named twice",
            ),
        ];
        for (text, expected) in cases {
            let error = plan(text).unwrap_err();
            assert!(error.contains(expected), "{text:?}: {error}");
            assert!(!error.contains("s3cret"), "{error}");
        }
    }

    #[test]
    fn a_flag_given_to_run_beats_the_file() {
        let overrides = Overrides {
            store: Some("sqlite://flag.db".into()),
            table_prefix: None,
        };
        let plan = parse(
            "store = \"sqlite://file.db\"\n[[consumer]]\nconsumer = \"a\"\nsource = \"-\"\nprint = true",
            &overrides,
        )
        .unwrap();
        assert_eq!(plan.jobs[0].cli.global.store, "sqlite://flag.db");
        assert_eq!(plan.jobs[0].store_from, "flag");
    }

    #[test]
    fn the_shown_command_line_hides_secrets() {
        let argv: Vec<String> = [
            "idemq",
            "--store",
            "postgres://app:hunter2@db/x",
            "consume",
            "--http-header",
            "Authorization: Bearer tok3n",
        ]
        .map(String::from)
        .to_vec();
        let shown = redacted_argv(&argv);
        assert!(
            !shown.contains("hunter2") && !shown.contains("tok3n"),
            "{shown}"
        );
        assert!(shown.contains("Authorization: ***"), "{shown}");
    }
}
