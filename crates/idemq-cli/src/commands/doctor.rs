//! `idemq doctor`: per consumer, what its broker says (the settings that
//! can drop unprocessed messages, how long the broker can still deliver a
//! message) beside what its inbox holds, with a verdict.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use idemq::source::health::{human, BrokerHealth, Horizon};
use serde_json::json;

use crate::backend::Backend;
use crate::endpoint::Endpoint;
use crate::{config, DoctorArgs, GlobalArgs};

/// The exit status when a consumer's verdict is a problem.
pub const PROBLEM: u8 = 4;

/// One consumer to examine: its name and its source.
struct Target {
    consumer: String,
    source: Endpoint,
}

/// What doctor concludes of one consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Nothing found.
    Ok,
    /// Nothing wrong found, but something could not be checked or proven.
    Check,
    /// A loss risk, or a retention shorter than the broker's horizon.
    Problem,
}

impl Verdict {
    fn word(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Check => "check",
            Self::Problem => "PROBLEM",
        }
    }

    fn max_by(self, other: Self) -> Self {
        let rank = |v: Self| match v {
            Self::Ok => 0,
            Self::Check => 1,
            Self::Problem => 2,
        };
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

/// The consumers of `--config`, or the one of `--source` and `--consumer`.
fn targets(args: &DoctorArgs, global: &GlobalArgs) -> Result<Vec<Target>> {
    if let Some(path) = &args.config {
        let found: Vec<Target> = config::consumers(path, &global.given)?
            .into_iter()
            .map(|(consumer, source)| Target { consumer, source })
            .collect();
        if found.is_empty() {
            return Err(crate::exit::usage(format!(
                "{} has no [[consumer]]",
                path.display()
            )));
        }
        return Ok(found);
    }
    match (&args.source, &args.consumer) {
        (Some(source), Some(consumer)) => Ok(vec![Target {
            consumer: consumer.clone(),
            source: source.clone(),
        }]),
        _ => Err(crate::exit::usage(
            "give --config FILE, or --source URL with --consumer NAME",
        )),
    }
}

/// Reads every consumer's broker and inbox and prints the verdicts; exits
/// with [`PROBLEM`] when one is a problem.
pub async fn run<B: Backend>(
    store: &B,
    global: &GlobalArgs,
    args: &DoctorArgs,
) -> Result<ExitCode> {
    let targets = targets(args, global)?;
    let stats = store
        .stats()
        .await
        .map_err(|e| super::admin_error(e, "reading the inbox"))?;
    let now_ms = i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis(),
    )
    .unwrap_or(i64::MAX);
    let keep = args.older_than.as_ref().map(|d| d.value);
    let mut reports = Vec::new();
    let mut worst = Verdict::Ok;
    for target in &targets {
        let inbox = stats.iter().find(|s| s.consumer == target.consumer);
        let keys = inbox.map_or(0, |s| s.processed);
        let age = inbox
            .and_then(|s| s.oldest_ms)
            .map(|oldest| Duration::from_millis(u64::try_from(now_ms - oldest).unwrap_or(0)));
        let health = match &target.source {
            Endpoint::Broker { broker, url } => Some((broker.inspect)(url).await),
            Endpoint::File(_) | Endpoint::Std => None,
        };
        let (verdict, reasons) = judge(health.as_ref(), keep);
        worst = worst.max_by(verdict);
        reports.push(json!({
            "consumer": target.consumer,
            "source": target.source.to_string(),
            "inbox_keys": keys,
            "inbox_age": age.map(format_age),
            "horizon": health.as_ref().map(|h| match h {
                Ok(h) => h.horizon.to_string(),
                Err(e) => format!("unknown ({e})"),
            }),
            "risks": health.as_ref().and_then(|h| h.as_ref().ok()).map_or_else(Vec::new, |h| {
                h.risks.iter().map(ToString::to_string).collect()
            }),
            "unchecked": health.as_ref().and_then(|h| h.as_ref().ok()).map_or_else(Vec::new, |h| h.unchecked.clone()),
            "retention": keep.map(human),
            "verdict": verdict.word(),
            "why": reasons,
        }));
    }
    if args.json {
        println!("{}", serde_json::Value::Array(reports));
    } else {
        for report in &reports {
            print_report(report);
        }
    }
    Ok(if worst == Verdict::Problem {
        ExitCode::from(PROBLEM)
    } else {
        ExitCode::SUCCESS
    })
}

/// The verdict on one consumer and why, from its broker's `health` (`None`:
/// a file, no broker) and the inbox retention `keep` (`--older-than`).
fn judge(
    health: Option<&Result<BrokerHealth, idemq::SourceError>>,
    keep: Option<Duration>,
) -> (Verdict, Vec<String>) {
    let health = match health {
        None => return (Verdict::Ok, vec!["a file: no broker to redeliver".into()]),
        Some(Err(e)) => {
            return (
                Verdict::Check,
                vec![format!("the broker could not be read: {e}")],
            )
        }
        Some(Ok(health)) => health,
    };
    let mut verdict = Verdict::Ok;
    let mut why = Vec::new();
    if !health.risks.is_empty() {
        verdict = Verdict::Problem;
        why.push(format!(
            "{} broker setting(s) can drop messages before they are processed",
            health.risks.len()
        ));
    }
    match (&health.horizon, keep) {
        (Horizon::Bounded { limit, .. }, Some(keep)) if keep < *limit => {
            verdict = Verdict::Problem;
            why.push(format!(
                "pruning rows older than {} lets through a duplicate the broker delivers up to {} after publication: prune no sooner than {}",
                human(keep),
                human(*limit),
                human(*limit)
            ));
        }
        (Horizon::Bounded { limit, .. }, None) => why.push(format!(
            "prune inbox rows no sooner than {} (idemq prune --older-than {})",
            human(*limit),
            human(*limit)
        )),
        (Horizon::Bounded { .. }, Some(_)) => {}
        (Horizon::Unbounded { .. }, _) => {
            verdict = verdict.max_by(Verdict::Check);
            why.push("the broker keeps a message until it is acknowledged: keep inbox rows longer than the longest time a consumer can be down".into());
        }
        (Horizon::Unknown { .. }, _) => {
            verdict = verdict.max_by(Verdict::Check);
            why.push("the broker's retention was not read: keep inbox rows longer than it".into());
        }
        _ => verdict = verdict.max_by(Verdict::Check),
    }
    if !health.unchecked.is_empty() {
        verdict = verdict.max_by(Verdict::Check);
    }
    (verdict, why)
}

/// `3d 4h`, `5h 10m`, `42s`.
fn format_age(age: Duration) -> String {
    let secs = age.as_secs();
    let (d, h, m) = (secs / 86_400, secs % 86_400 / 3_600, secs % 3_600 / 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{secs}s"),
        (0, 0, m) => format!("{m}m"),
        (0, h, m) => format!("{h}h {m}m"),
        (d, h, _) => format!("{d}d {h}h"),
    }
}

/// One consumer's report as text.
fn print_report(report: &serde_json::Value) {
    let text = |key: &str| report[key].as_str().unwrap_or("-").to_owned();
    let list = |key: &str| -> Vec<String> {
        report[key]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|i| i.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    println!("consumer {}", text("consumer"));
    println!("  source       {}", text("source"));
    let age = match report["inbox_age"].as_str() {
        Some(age) => format!("; oldest {age} old"),
        None => String::new(),
    };
    println!("  inbox        {} keys{age}", report["inbox_keys"]);
    if let Some(retention) = report["retention"].as_str() {
        println!("  retention    rows older than {retention} pruned (--older-than)");
    }
    println!("  redelivery   {}", text("horizon"));
    let risks = list("risks");
    if risks.is_empty() {
        println!("  loss risks   none found");
    }
    for risk in risks {
        println!("  loss risk    {risk}");
    }
    for what in list("unchecked") {
        println!("  not checked  {what}");
    }
    println!("  verdict      {}", text("verdict"));
    for why in list("why") {
        println!("               {why}");
    }
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounded(days: u64) -> Horizon {
        Horizon::Bounded {
            limit: Duration::from_secs(days * 86_400),
            setting: "topic t retention.ms".into(),
        }
    }

    #[test]
    fn a_retention_under_the_horizon_is_a_problem_and_above_it_is_ok() {
        let health = Ok(BrokerHealth::new(bounded(7)));
        let day = Duration::from_secs(86_400);
        assert_eq!(judge(Some(&health), Some(day)).0, Verdict::Problem);
        assert_eq!(judge(Some(&health), Some(day * 7)).0, Verdict::Ok);
        let (verdict, why) = judge(Some(&health), None);
        assert_eq!(verdict, Verdict::Ok);
        assert!(why[0].contains("--older-than 7d"), "{why:?}");
    }

    #[test]
    fn risks_are_problems_and_unknowns_are_checks() {
        let risky =
            Ok(
                BrokerHealth::new(bounded(7)).with_risks(vec![idemq::source::loss::LossRisk {
                    place: "queue q".into(),
                    setting: "max-length=5".into(),
                    effect: "drops".into(),
                    remedy: "don't".into(),
                }]),
            );
        assert_eq!(judge(Some(&risky), None).0, Verdict::Problem);
        let unknown = Ok(BrokerHealth::new(Horizon::Unknown { why: "x".into() }));
        assert_eq!(judge(Some(&unknown), None).0, Verdict::Check);
        assert_eq!(judge(None, None).0, Verdict::Ok);
    }

    #[test]
    fn ages_read_in_their_largest_units() {
        assert_eq!(format_age(Duration::from_secs(42)), "42s");
        assert_eq!(
            format_age(Duration::from_secs(3 * 86_400 + 4 * 3_600)),
            "3d 4h"
        );
        assert_eq!(format_age(Duration::from_secs(5 * 3_600 + 600)), "5h 10m");
    }
}
