//! `idemq dlq list` and `idemq dlq replay`.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

use anyhow::{Context, Result};
use idemq::source::queue::{MemoryQueue, QueueSource};
use idemq::source::{Delivery, Source};
use idemq::store::DeadLetterRecord;
use idemq::{ConflictPolicy, Consumer, DeliveryMeta, Outcome, SourceError};

use crate::backend::Backend;
use crate::interrupt::Interrupt;
use crate::output::{cell, dead_letter_json, origin, shell_word, time, Table};
use crate::{exit, sink, DlqListArgs, DlqReplayArgs, ProcessingArgs, SinkArgs};

/// Dead letters fetched per query while collecting.
const PAGE: u32 = 500;

/// Lists dead letters as a table (payloads truncated) or JSON (complete).
pub async fn list<B: Backend>(store: &B, args: &DlqListArgs) -> Result<ExitCode> {
    let letters = store
        .dead_letters(args.consumer.as_deref(), args.after_id, args.limit)
        .await
        .map_err(|e| super::admin_error(e, "listing dead letters"))?;
    if args.json {
        let rows: Vec<_> = letters.iter().map(dead_letter_json).collect();
        println!("{}", serde_json::Value::Array(rows));
        return Ok(ExitCode::SUCCESS);
    }
    if letters.is_empty() {
        println!("no dead letters");
        return Ok(ExitCode::SUCCESS);
    }
    let mut table = Table::new(&[
        "ID", "CONSUMER", "KEY", "REASON", "ATTEMPTS", "CREATED", "ORIGIN", "ERROR", "PAYLOAD",
    ]);
    for d in &letters {
        table.row(vec![
            d.id.to_string(),
            cell(&d.consumer, 30),
            d.key
                .as_deref()
                .map_or_else(|| "-".to_owned(), |k| cell(k, 40)),
            d.reason.clone(),
            d.attempts.to_string(),
            time(d.created_ms),
            cell(&origin(d), 40),
            cell(&d.error, 80),
            cell(&String::from_utf8_lossy(&d.message.payload), 60),
        ]);
    }
    print!("{table}");
    if letters.len() == usize::try_from(args.limit).unwrap_or(usize::MAX) {
        if let Some(last) = letters.last() {
            println!("(more may follow: --after-id {})", last.id);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs one consumer's dead letters through its handler again, one at a
/// time, and deletes the letters that were resolved or replaced: the engine
/// of `idemq dlq replay` and of the console's replay buttons.
pub(crate) struct Replayer<B: Backend> {
    consumer: Consumer<B>,
    last_outcome: Arc<Mutex<Option<Outcome>>>,
    ignore_conflicts: bool,
}

impl<B: Backend> Replayer<B> {
    /// The consumer `name` with the sink and processing options of a
    /// `consume` run (the same key and fingerprint, so keys match the inbox);
    /// runs the sink's `--init-sql`.
    pub(crate) async fn new(
        name: &str,
        store: B,
        processing: &ProcessingArgs,
        sink_args: &SinkArgs,
    ) -> Result<Self> {
        let sink::Sink { handler, statement } = sink::build::<B>(sink_args).await?;
        let last_outcome: Arc<Mutex<Option<Outcome>>> = Arc::default();
        let hook_slot = Arc::clone(&last_outcome);
        let consumer = super::configure(Consumer::builder(name, store), processing)
            .handler(handler)
            .concurrency(1)
            .on_outcome(move |outcome| {
                *lock(&hook_slot) = Some(outcome.clone());
            })
            .build()
            .map_err(exit::usage)?;
        sink::init(consumer.store().as_ref(), sink_args, statement.as_deref()).await?;
        Ok(Self {
            consumer,
            last_outcome,
            ignore_conflicts: ConflictPolicy::from(processing.on_conflict)
                == ConflictPolicy::Ignore,
        })
    }

    /// The store the consumer runs on.
    pub(crate) fn store(&self) -> &Arc<B> {
        self.consumer.store()
    }

    /// Runs `letter`'s message (with its original origin) through the
    /// handler until it settles or `stop` fires; deletes the letter when the
    /// verdict says so.
    pub(crate) async fn replay(
        &self,
        letter: &DeadLetterRecord,
        stop: impl Future<Output = ()>,
    ) -> Result<Verdict> {
        *lock(&self.last_outcome) = None;
        let queue = MemoryQueue::new(letter.meta.topic.clone().unwrap_or_default());
        queue.push(letter.message.clone());
        queue.close();
        let source = ReplaySource {
            inner: queue.source(),
            meta: letter.meta.clone(),
        };
        self.consumer
            .run_until(source, stop)
            .await
            .context("replaying")?;
        let outcome = lock(&self.last_outcome).take();
        let verdict = Verdict::of(
            outcome.as_ref(),
            self.ignore_conflicts,
            letter.key.as_deref(),
        );
        if verdict.deletes() {
            self.store()
                .delete_dead_letter(letter.id)
                .await
                .with_context(|| format!("deleting dead letter #{}", letter.id))?;
        }
        Ok(verdict)
    }
}

/// Replays dead letters one at a time; deletes the ones that were resolved or
/// replaced by a new dead letter.
pub async fn replay<B: Backend>(store: B, args: DlqReplayArgs) -> Result<ExitCode> {
    let replayer = Replayer::new(&args.consumer, store, &args.processing, &args.sink).await?;
    let store = Arc::clone(replayer.store());

    let wanted: Option<BTreeSet<i64>> =
        (!args.selection.all).then(|| args.selection.ids.iter().copied().collect());
    let letters = collect(store.as_ref(), &args.consumer, wanted.as_ref()).await?;
    let mut missing = 0;
    if let Some(wanted) = &wanted {
        for id in wanted {
            if !letters.iter().any(|d| d.id == *id) {
                eprintln!(
                    "idemq: dead letter #{id} not found for consumer {:?}",
                    args.consumer
                );
                missing += 1;
            }
        }
    }

    let interrupt = Interrupt::listen();
    let mut tally = Tally::default();
    for letter in &letters {
        if interrupt.is_set() {
            break;
        }
        let verdict = replayer.replay(letter, interrupt.wait()).await?;
        tally.count(&verdict);
        println!("#{} {}: {}", letter.id, key_label(letter), verdict);
    }

    println!(
        "replayed {} of {} dead letters of consumer {}: resolved={} dead_lettered_again={} kept={}",
        tally.resolved + tally.again + tally.kept,
        letters.len(),
        args.consumer,
        tally.resolved,
        tally.again,
        tally.kept
    );
    if tally.again > 0 {
        println!(
            "dead letters: idemq dlq list --consumer {}",
            shell_word(&args.consumer)
        );
    }
    Ok(if interrupt.is_set() {
        ExitCode::from(exit::INTERRUPTED)
    } else if missing > 0 {
        ExitCode::from(exit::NOT_FOUND)
    } else {
        ExitCode::SUCCESS
    })
}

/// The consumer's dead letters present now (all, or those in `wanted`), oldest first.
pub(crate) async fn collect<B: Backend>(
    store: &B,
    consumer: &str,
    wanted: Option<&BTreeSet<i64>>,
) -> Result<Vec<DeadLetterRecord>> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = store
            .dead_letters(Some(consumer), after, PAGE)
            .await
            .context("reading dead letters")?;
        let Some(last) = page.last() else { break };
        after = last.id;
        let full = page.len() == PAGE as usize;
        out.extend(
            page.into_iter()
                .filter(|d| wanted.is_none_or(|w| w.contains(&d.id))),
        );
        if !full || wanted.is_some_and(|w| w.len() == out.len()) {
            break;
        }
    }
    Ok(out)
}

/// `key "…"` or `(no key)`.
fn key_label(letter: &DeadLetterRecord) -> String {
    match &letter.key {
        Some(key) => format!("key {:?}", key),
        None => "(no key)".to_owned(),
    }
}

/// What replaying one dead letter came to.
pub(crate) enum Verdict {
    /// Processed now.
    Processed,
    /// Already processed (with the same payload) since it was dead-lettered.
    Duplicate { processed_ms: i64 },
    /// Dead-lettered again. Under the same key the store kept the one
    /// letter it has for this message (`same_letter`: same letter id, so no
    /// new row); under another key a new letter replaces this one.
    Again {
        reason: String,
        error: String,
        same_letter: bool,
    },
    /// A conflict ignored by policy: nothing was written.
    ConflictIgnored,
    /// No final outcome (interrupted while waiting for a retry).
    Unfinished { error: Option<String> },
}

impl Verdict {
    /// `key`: the dead letter's key. The replay restores the letter's
    /// message and origin, so a new letter has the same letter id (and is
    /// not written again) unless its key differs.
    fn of(outcome: Option<&Outcome>, ignore_conflicts: bool, key: Option<&str>) -> Self {
        match outcome {
            Some(Outcome::Processed { .. }) => Verdict::Processed,
            Some(Outcome::Duplicate { record }) => Verdict::Duplicate {
                processed_ms: record.first_seen_ms,
            },
            Some(Outcome::DeadLettered {
                reason,
                error,
                key: new_key,
            }) => Verdict::Again {
                reason: reason.code().to_owned(),
                error: error.clone(),
                same_letter: new_key.as_deref() == key,
            },
            Some(Outcome::Conflict { .. }) if ignore_conflicts => Verdict::ConflictIgnored,
            Some(Outcome::Conflict {
                record,
                fingerprint,
            }) => Verdict::Again {
                reason: "conflict".to_owned(),
                error: format!(
                    "key {:?} was processed with fingerprint {}; this message has {}",
                    record.key, record.fingerprint, fingerprint
                ),
                same_letter: Some(record.key.as_str()) == key,
            },
            Some(Outcome::RetryLater { error, .. }) => Verdict::Unfinished {
                error: Some(error.clone()),
            },
            // An outcome kind newer than this command: the letter stays.
            None | Some(_) => Verdict::Unfinished { error: None },
        }
    }

    /// Whether the message is now processed (now or before).
    pub(crate) fn resolved(&self) -> bool {
        matches!(self, Verdict::Processed | Verdict::Duplicate { .. })
    }

    /// Whether the original dead letter goes.
    pub(crate) fn deletes(&self) -> bool {
        matches!(
            self,
            Verdict::Processed
                | Verdict::Duplicate { .. }
                | Verdict::Again {
                    same_letter: false,
                    ..
                }
        )
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Processed => f.write_str("processed; dead letter deleted"),
            Verdict::Duplicate { processed_ms } => write!(
                f,
                "duplicate (already processed at {}); dead letter deleted",
                time(*processed_ms)
            ),
            Verdict::Again {
                reason,
                error,
                same_letter,
            } => write!(
                f,
                "dead-lettered again ({reason}: {}); {}",
                cell(error, 200),
                if *same_letter {
                    "dead letter kept (one letter per message)"
                } else {
                    "replaced by the new dead letter (another key)"
                }
            ),
            Verdict::ConflictIgnored => f.write_str("conflict ignored; dead letter kept"),
            Verdict::Unfinished { error: Some(e) } => {
                write!(f, "not finished ({}); dead letter kept", cell(e, 200))
            }
            Verdict::Unfinished { error: None } => f.write_str("not run; dead letter kept"),
        }
    }
}

/// Counts of verdicts.
#[derive(Default)]
struct Tally {
    resolved: u64,
    again: u64,
    kept: u64,
}

impl Tally {
    fn count(&mut self, verdict: &Verdict) {
        match verdict {
            Verdict::Processed | Verdict::Duplicate { .. } => self.resolved += 1,
            Verdict::Again { .. } => self.again += 1,
            Verdict::ConflictIgnored | Verdict::Unfinished { .. } => self.kept += 1,
        }
    }
}

/// A one-message [`MemoryQueue`] source that restores the dead letter's
/// original origin (source, topic, partition, offset) on each delivery, so a
/// new dead letter still says where the message first came from.
struct ReplaySource {
    inner: QueueSource,
    meta: DeliveryMeta,
}

impl Source for ReplaySource {
    fn next<'life0, 'async_trait>(
        &'life0 mut self,
    ) -> Pin<Box<dyn Future<Output = Result<Option<Delivery>, SourceError>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move {
            let mut delivery = self.inner.next().await?;
            if let Some(d) = delivery.as_mut() {
                d.meta.source.clone_from(&self.meta.source);
                d.meta.topic.clone_from(&self.meta.topic);
                d.meta.partition = self.meta.partition;
                d.meta.offset = self.meta.offset;
            }
            Ok(delivery)
        })
    }
}
