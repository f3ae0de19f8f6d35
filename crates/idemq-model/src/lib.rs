//! An exhaustively checked model of idemq's delivery protocol: claim, lease,
//! heartbeat, fencing, commit, ack, redelivery, crash and lease expiry.
//!
//! The model is small on purpose: `messages` messages (one business key
//! each) delivered at least once by a broker that redelivers every delivery
//! that is not acked and may duplicate a message, and `workers` consumer
//! workers that each hold at most one delivery, can crash at any step and
//! restart empty-handed. The [`stateright`] checker explores every
//! interleaving of their steps up to the fault budgets (crashes and handler
//! failures, broker duplicates, premature lease expiries) and checks the
//! properties in every reachable state.
//!
//! Two store families are modelled, as in `idemq::store`:
//!
//! - [`StoreKind::Transactional`] (the SQL stores): the claim row is inserted
//!   in a transaction that the handler's effect is written through; a
//!   concurrent claimer of the same key *waits* on the row lock; commit makes
//!   row and effect durable at once; a crash or failure rolls both back.
//! - [`StoreKind::PartitionedTransactional`] (the time-partitioned
//!   PostgreSQL inbox): no unique index spans the partitions, so the claim
//!   takes the key's transaction-scoped lock, then looks the key up in a
//!   statement of its own, then inserts; a concurrent claimer waits on the
//!   lock, also when the key turns out to be done.
//! - [`StoreKind::Lease`] (Redis, memory): the claim is `in-flight(token)`
//!   with a rising fencing number; the lease can expire at any time (a
//!   nondeterministic action: a paused or partitioned holder); a heartbeat
//!   tells a live holder that its lease is gone; the effect is a write to a
//!   downstream system that refuses a fencing number lower than the highest
//!   it has accepted for the key; completion is a compare-and-set on the
//!   token; a crashed holder's lease stays until it expires.
//! - [`StoreKind::LeaseRecord`] (the Redis store): the same lease, kept as
//!   *one record per key* that carries the key's fencing counter and the
//!   lease's deadline. An expired lease is not deleted: it stays, marked
//!   expired, until a claim takes it over (counter + 1) or its holder's
//!   heartbeat renews it (nobody took it over: the holder still holds it);
//!   a release leaves a free record that keeps the counter. Fencing numbers
//!   are therefore per key, and the property [`NO_FENCE_REUSE`] checks that
//!   no key ever hands out one number twice.
//!
//! The engine order is claim → handler effect → commit → ack; a duplicate is
//! acked, a busy key (live lease elsewhere), a lost lease or a failure is
//! nacked (redelivered).
//!
//! [`Flaws`] switch on known-bad variants, each of which the checker must
//! catch: check-then-insert claims, ack before commit, completion without the
//! compare-and-set, downstream writes without the fencing check, a record
//! lease whose release deletes the record (and with it the counter), and a
//! partitioned claim that looks the key up on a snapshot older than its lock.
//!
//! ```
//! use idemq_model::{InboxModel, StoreKind};
//! let report = InboxModel::new(StoreKind::Transactional).check();
//! assert!(report.violations.is_empty(), "{report}");
//! assert!(report.unique_states > 100);
//! ```

#![warn(missing_docs)]

use std::fmt;

use stateright::{Checker, HasDiscoveries, Model, Property};

/// Which store family the model runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StoreKind {
    /// Claim row and effect in one database transaction (SQL stores).
    Transactional,
    /// The time-partitioned SQL inbox: no unique index spans the
    /// partitions, so a claim takes the key's transaction-scoped lock, then
    /// looks for the key in a statement of its own (it sees what the
    /// previous holder committed), then inserts; the lock is held until the
    /// claim's transaction ends, also for a duplicate.
    PartitionedTransactional,
    /// A lease with token, expiry, heartbeat and a global rising fencing
    /// number (the memory store).
    Lease,
    /// A lease kept as one record per key holding the key's fencing counter
    /// and the lease deadline (the Redis store; see the crate docs).
    LeaseRecord,
}

impl StoreKind {
    fn is_lease(self) -> bool {
        matches!(self, Self::Lease | Self::LeaseRecord)
    }
}

/// Known-bad protocol variants; the checker must find a counterexample for each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flaws {
    /// The claim reads the key first and inserts in a second step (a `SELECT`
    /// that cannot see an uncommitted claim, then an unguarded `INSERT`; for
    /// leases a `GET` then an unconditional `SET`).
    pub check_then_insert: bool,
    /// The delivery is acked after the handler and before the commit.
    pub ack_before_commit: bool,
    /// Lease completion writes `done` without comparing the token.
    pub complete_without_cas: bool,
    /// The downstream accepts effect writes whatever their fencing number.
    pub write_without_fencing: bool,
    /// [`StoreKind::LeaseRecord`]: a release deletes the key's record instead
    /// of leaving a free record with the counter, so the counter starts again.
    pub release_forgets_fence: bool,
    /// [`StoreKind::PartitionedTransactional`]: the look-up reads a snapshot
    /// taken before the lock was granted (one statement that locks and
    /// looks, or REPEATABLE READ), so it misses what the previous holder
    /// committed while it waited.
    pub look_before_lock: bool,
}

/// The model: store kind, sizes, fault budgets and flaws.
#[derive(Clone, Debug)]
pub struct InboxModel {
    /// The store family.
    pub store: StoreKind,
    /// Messages (= distinct business keys), each published once.
    pub messages: u8,
    /// Consumer workers (each handles one delivery at a time).
    pub workers: u8,
    /// Worker crashes plus retryable handler failures, in total.
    pub max_faults: u8,
    /// Extra copies the broker may deliver (duplicates, producer retries).
    pub max_duplicates: u8,
    /// Lease expiries while the holder is still alive (lease stores). The
    /// lease of a crashed holder may always expire: that is time passing.
    pub max_premature_expiries: u8,
    /// Known-bad variants to switch on.
    pub flaws: Flaws,
}

impl InboxModel {
    /// The default small bounds: 2 messages, 2 workers, 1 fault (crash or
    /// handler failure), 1 duplicate, 1 premature expiry, no flaws.
    pub fn new(store: StoreKind) -> Self {
        Self {
            store,
            messages: 2,
            workers: 2,
            max_faults: 1,
            max_duplicates: 1,
            max_premature_expiries: 1,
            flaws: Flaws::default(),
        }
    }

    /// The same model with `flaws` switched on.
    pub fn with_flaws(mut self, flaws: Flaws) -> Self {
        self.flaws = flaws;
        self
    }

    /// Checks the model exhaustively (breadth-first, every reachable state)
    /// and reports the state counts and the violated properties.
    pub fn check(self) -> Report {
        self.run(false)
    }

    /// Like [`check`](Self::check), but stops at the first violated property
    /// (for the known-bad variants, whose counterexamples are short).
    pub fn find_violation(self) -> Report {
        self.run(true)
    }

    fn run(self, stop_at_violation: bool) -> Report {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(2));
        let mut builder = self.checker().threads(threads);
        if stop_at_violation {
            builder = builder.finish_when(HasDiscoveries::AnyFailures);
        }
        let checker = builder.spawn_bfs().join();
        let mut violations: Vec<Violation> = checker
            .discoveries()
            .into_iter()
            .filter(|(name, _)| *name != ALL_APPLIED)
            .map(|(name, path)| Violation {
                property: name,
                trace: path
                    .into_actions()
                    .iter()
                    .map(|a| format!("{a:?}"))
                    .collect(),
            })
            .collect();
        violations.sort_by_key(|v| v.property);
        Report {
            states: checker.state_count(),
            unique_states: checker.unique_state_count(),
            max_depth: checker.max_depth(),
            complete: checker.is_done(),
            all_applied_reachable: checker.discovery(ALL_APPLIED).is_some(),
            violations,
        }
    }

    fn live_holder(&self, s: &State, key: u8, token: u8) -> bool {
        token != 0 && Self::holder_of(s, key, token)
    }

    fn holder_of(s: &State, key: u8, token: u8) -> bool {
        s.workers.iter().any(|w| {
            w.msg == key && w.token == token && matches!(w.phase, Phase::Holding | Phase::Effected)
        })
    }

    /// No worker holds a delivery and the broker has nothing to deliver.
    fn quiescent(s: &State) -> bool {
        s.workers.iter().all(|w| w.phase == Phase::Idle) && s.ready.iter().all(|&n| n == 0)
    }

    fn applied_once(&self, s: &State, k: usize) -> bool {
        match self.store {
            StoreKind::Transactional | StoreKind::PartitionedTransactional => {
                s.tx[k].committed && s.tx[k].effects == 1
            }
            StoreKind::Lease | StoreKind::LeaseRecord => match s.rec[k] {
                // The downstream holds the completing holder's write.
                Rec::Done(fence) => s.down[k].max_fence == fence && s.down[k].writes >= 1,
                _ => false,
            },
        }
    }
}

/// The outcome of one exhaustive check.
#[derive(Clone, Debug)]
pub struct Report {
    /// States generated, repeats included.
    pub states: usize,
    /// Distinct states.
    pub unique_states: usize,
    /// The longest path explored.
    pub max_depth: usize,
    /// Whether every reachable state was visited.
    pub complete: bool,
    /// Whether a state with every message applied once is reachable (the
    /// model is not vacuous).
    pub all_applied_reachable: bool,
    /// Violated properties, each with a counterexample.
    pub violations: Vec<Violation>,
}

impl Report {
    /// Whether `property` was violated.
    pub fn violated(&self, property: &str) -> bool {
        self.violations.iter().any(|v| v.property == property)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} states ({} unique), depth {}, complete: {}",
            self.states, self.unique_states, self.max_depth, self.complete
        )?;
        for v in &self.violations {
            write!(f, "\n  violated {:?}: {}", v.property, v.trace.join(" → "))?;
        }
        Ok(())
    }
}

/// A violated property and the steps that lead to it.
#[derive(Clone, Debug)]
pub struct Violation {
    /// The property's name ([`NO_DOUBLE_EFFECT`], [`NO_STALE_COMPLETION`], [`NO_LOSS`]).
    pub property: &'static str,
    /// The counterexample, one action per step.
    pub trace: Vec<String>,
}

/// Property: no effect is applied twice.
pub const NO_DOUBLE_EFFECT: &str = "no double effect";
/// Property: a holder that lost its claim never completes (commits or writes over a newer holder).
pub const NO_STALE_COMPLETION: &str = "no stale holder completes";
/// Property: no key hands out a fencing number twice (each acquisition gets a
/// higher one than every earlier acquisition of the key).
pub const NO_FENCE_REUSE: &str = "no fencing number handed out twice";
/// Property: when everything has settled, every message was applied once.
pub const NO_LOSS: &str = "no loss at quiescence";
/// A `sometimes` property: the model can reach "everything applied".
pub const ALL_APPLIED: &str = "all applied (reachable)";

/// A worker's step within one delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// No delivery in hand.
    Idle,
    /// Holds a delivery; next: claim.
    Received,
    /// Check-then-insert: read "absent"; next: the unguarded insert. A
    /// partitioned claim: holds the key's lock; next: the look-up (with
    /// look-before-lock: has looked; next: the lock).
    Checked,
    /// Holds the claim (row lock or lease); next: the handler's effect.
    Holding,
    /// The effect is written (in the transaction, or downstream); next: commit.
    Effected,
    /// Committed; next: ack.
    Completed,
    /// The key is done already (duplicate); next: ack.
    Duplicate,
    /// Busy, lost lease, refused write or failure; next: nack (redelivery).
    Retry,
}

/// One worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Worker {
    phase: Phase,
    msg: u8,
    /// The lease token it holds (unique per acquisition), 0 for none.
    token: u8,
    /// The fencing number of that lease (= the token for [`StoreKind::Lease`]).
    fence: u8,
    /// Its delivery was acked already (ack-before-commit).
    acked: bool,
}

/// Transactional store: the inbox row and the committed effects of a key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TxKey {
    committed: bool,
    /// Workers whose open transaction holds an uncommitted claim row (bit set).
    lockers: u8,
    /// Committed effects.
    effects: u8,
}

/// Lease store: the record of a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rec {
    /// No record (never claimed, rolled back or expired; a record lease's
    /// counter is then 0).
    Absent,
    /// Record lease only: released, keeping the key's fencing counter.
    Free(u8),
    /// Held by the lease with this token and fencing number; a record lease
    /// stays after its deadline (`expired`) until taken over or renewed.
    InFlight {
        /// The holder's token.
        token: u8,
        /// The holder's fencing number.
        fence: u8,
        /// The deadline has passed (record lease only).
        expired: bool,
    },
    /// Completed by the lease with this fencing number.
    Done(u8),
}

impl Rec {
    fn held_by(self, token: u8) -> bool {
        matches!(self, Rec::InFlight { token: t, .. } if t == token && token != 0)
    }
}

/// The downstream system of a lease store, per key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Downstream {
    /// The highest fencing number accepted.
    max_fence: u8,
    /// Accepted writes.
    writes: u8,
    /// Writes accepted with a fencing number below one accepted before, or after completion.
    stale_writes: u8,
    /// Leases on this key lost after or before their holder wrote: premature
    /// expiries, and crashes of holders that had written.
    losses: u8,
}

/// The whole system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// Copies of each message ready for delivery.
    ready: Vec<u8>,
    workers: Vec<Worker>,
    tx: Vec<TxKey>,
    rec: Vec<Rec>,
    down: Vec<Downstream>,
    /// Completions per key (commits that made the key done).
    completions: Vec<u8>,
    /// Completions by a holder that no longer held the claim.
    stale_completions: u8,
    /// Per key, the highest fencing number handed out.
    max_issued: Vec<u8>,
    /// Acquisitions handed a fencing number not above an earlier one of the key.
    fence_reuses: u8,
    next_token: u8,
    faults: u8,
    duplicates: u8,
    premature_expiries: u8,
}

/// What can happen next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Idle worker takes a copy of message `msg` from the broker.
    Deliver {
        /// The worker.
        worker: u8,
        /// The message.
        msg: u8,
    },
    /// The worker takes its next protocol step.
    Step(u8),
    /// The worker crashes: its transaction rolls back, its unacked delivery
    /// is redelivered, a lease it holds stays until it expires.
    Crash(u8),
    /// The handler fails retryably: rollback (or lease release), nack.
    Fail(u8),
    /// The lease holder's heartbeat finds the lease gone.
    HeartbeatLost(u8),
    /// The lease on key `msg` expires.
    Expire(u8),
    /// Record lease: the holder's heartbeat renews its expired lease (nobody
    /// took it over).
    Renew(u8),
    /// The broker delivers one more copy of `msg`.
    Duplicate(u8),
}

impl Model for InboxModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let n = usize::from(self.messages);
        vec![State {
            ready: vec![1; n],
            workers: vec![
                Worker {
                    phase: Phase::Idle,
                    msg: 0,
                    token: 0,
                    fence: 0,
                    acked: false,
                };
                usize::from(self.workers)
            ],
            tx: vec![TxKey::default(); n],
            rec: vec![Rec::Absent; n],
            down: vec![Downstream::default(); n],
            completions: vec![0; n],
            stale_completions: 0,
            max_issued: vec![0; n],
            fence_reuses: 0,
            next_token: 0,
            faults: 0,
            duplicates: 0,
            premature_expiries: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for (i, w) in s.workers.iter().enumerate() {
            let i = i as u8;
            if w.phase == Phase::Idle {
                for (m, &n) in s.ready.iter().enumerate() {
                    if n > 0 {
                        actions.push(Action::Deliver {
                            worker: i,
                            msg: m as u8,
                        });
                    }
                }
                continue;
            }
            if self.step_enabled(s, usize::from(i), w) {
                actions.push(Action::Step(i));
            }
            if s.faults < self.max_faults {
                actions.push(Action::Crash(i));
                if matches!(w.phase, Phase::Holding | Phase::Effected) {
                    actions.push(Action::Fail(i));
                }
            }
            if self.store.is_lease() && matches!(w.phase, Phase::Holding | Phase::Effected) {
                match s.rec[usize::from(w.msg)] {
                    rec if !rec.held_by(w.token) => actions.push(Action::HeartbeatLost(i)),
                    Rec::InFlight { expired: true, .. } => actions.push(Action::Renew(i)),
                    _ => {}
                }
            }
        }
        if self.store.is_lease() {
            for (k, rec) in s.rec.iter().enumerate() {
                if let Rec::InFlight {
                    token,
                    expired: false,
                    ..
                } = *rec
                {
                    if !self.live_holder(s, k as u8, token)
                        || s.premature_expiries < self.max_premature_expiries
                    {
                        actions.push(Action::Expire(k as u8));
                    }
                }
            }
        }
        if s.duplicates < self.max_duplicates {
            for m in 0..self.messages {
                actions.push(Action::Duplicate(m));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Deliver { worker, msg } => {
                s.ready[usize::from(msg)] -= 1;
                s.workers[usize::from(worker)] = Worker {
                    phase: Phase::Received,
                    msg,
                    token: 0,
                    fence: 0,
                    acked: false,
                };
            }
            Action::Step(i) => self.step(&mut s, usize::from(i)),
            Action::Crash(i) => {
                s.faults += 1;
                let i = usize::from(i);
                let w = s.workers[i].clone();
                let k = usize::from(w.msg);
                match self.store {
                    StoreKind::Transactional | StoreKind::PartitionedTransactional => {
                        s.tx[k].lockers &= !(1 << i)
                    }
                    StoreKind::Lease | StoreKind::LeaseRecord => {
                        // The lease stays until it expires; a written effect stays too.
                        if w.phase == Phase::Effected && s.rec[k].held_by(w.token) {
                            s.down[k].losses += 1;
                        }
                    }
                }
                if !w.acked {
                    s.ready[k] += 1;
                }
                s.workers[i] = idle();
            }
            Action::Fail(i) => {
                s.faults += 1;
                let i = usize::from(i);
                self.abandon(&mut s, i);
                s.workers[i].phase = Phase::Retry;
            }
            Action::HeartbeatLost(i) => {
                let i = usize::from(i);
                s.workers[i].phase = Phase::Retry;
                s.workers[i].token = 0;
                s.workers[i].fence = 0;
            }
            Action::Expire(k) => {
                let k = usize::from(k);
                if let Rec::InFlight { token, fence, .. } = s.rec[k] {
                    let live = self.live_holder(&s, k as u8, token);
                    if live {
                        s.premature_expiries += 1;
                    }
                    if self.store == StoreKind::LeaseRecord {
                        // The record stays, expired: a takeover counts the loss.
                        s.rec[k] = Rec::InFlight {
                            token,
                            fence,
                            expired: true,
                        };
                    } else {
                        if live {
                            s.down[k].losses += 1;
                        }
                        s.rec[k] = Rec::Absent;
                    }
                }
            }
            Action::Renew(i) => {
                let w = &s.workers[usize::from(i)];
                let k = usize::from(w.msg);
                if let Rec::InFlight { token, fence, .. } = s.rec[k] {
                    if token == w.token {
                        s.rec[k] = Rec::InFlight {
                            token,
                            fence,
                            expired: false,
                        };
                    }
                }
            }
            Action::Duplicate(m) => {
                s.duplicates += 1;
                s.ready[usize::from(m)] += 1;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_DOUBLE_EFFECT, |m: &InboxModel, s: &State| {
                let completions_ok = s.completions.iter().all(|&c| c <= 1);
                match m.store {
                    StoreKind::Transactional | StoreKind::PartitionedTransactional => {
                        completions_ok && s.tx.iter().all(|t| t.effects <= 1)
                    }
                    // A lease store cannot undo a write made by a holder that
                    // then lost its lease (crash, expiry): such writes are
                    // superseded by fencing. Any other second write is a double.
                    StoreKind::Lease | StoreKind::LeaseRecord => {
                        completions_ok && s.down.iter().all(|d| d.writes <= 1 + d.losses)
                    }
                }
            }),
            Property::always(NO_STALE_COMPLETION, |_: &InboxModel, s: &State| {
                s.stale_completions == 0 && s.down.iter().all(|d| d.stale_writes == 0)
            }),
            Property::always(NO_FENCE_REUSE, |_: &InboxModel, s: &State| {
                s.fence_reuses == 0
            }),
            Property::always(NO_LOSS, |m: &InboxModel, s: &State| {
                !InboxModel::quiescent(s)
                    || (0..usize::from(m.messages)).all(|k| m.applied_once(s, k))
            }),
            Property::sometimes(ALL_APPLIED, |m: &InboxModel, s: &State| {
                InboxModel::quiescent(s)
                    && (0..usize::from(m.messages)).all(|k| m.applied_once(s, k))
            }),
        ]
    }
}

fn idle() -> Worker {
    Worker {
        phase: Phase::Idle,
        msg: 0,
        token: 0,
        fence: 0,
        acked: false,
    }
}

impl InboxModel {
    /// Whether `Step` can run: a transactional claim waits on another's row lock.
    fn step_enabled(&self, s: &State, i: usize, w: &Worker) -> bool {
        let k = usize::from(w.msg);
        match (self.store, w.phase) {
            (StoreKind::Transactional, Phase::Received) if !self.flaws.check_then_insert => {
                s.tx[k].committed || s.tx[k].lockers == 0
            }
            // The lock: taken at once, or (the flaw) after the look-up.
            // Check-then-insert takes no lock at all.
            (StoreKind::PartitionedTransactional, Phase::Received) if !self.looks_first() => {
                s.tx[k].lockers & !(1 << i) == 0
            }
            (StoreKind::PartitionedTransactional, Phase::Checked)
                if self.looks_first() && !self.flaws.check_then_insert =>
            {
                s.tx[k].lockers & !(1 << i) == 0
            }
            _ => true,
        }
    }

    /// Partitioned claims: whether the look-up comes before the lock (the
    /// look-before-lock and check-then-insert flaws).
    fn looks_first(&self) -> bool {
        self.flaws.look_before_lock || self.flaws.check_then_insert
    }

    /// Rolls back the worker's claim: the transaction, or the lease by
    /// compare-and-delete (a record lease keeps its counter in a free record).
    fn abandon(&self, s: &mut State, i: usize) {
        let w = s.workers[i].clone();
        let k = usize::from(w.msg);
        match self.store {
            StoreKind::Transactional | StoreKind::PartitionedTransactional => {
                s.tx[k].lockers &= !(1 << i)
            }
            StoreKind::Lease | StoreKind::LeaseRecord => {
                if s.rec[k].held_by(w.token) {
                    s.rec[k] = if self.store == StoreKind::LeaseRecord
                        && !self.flaws.release_forgets_fence
                    {
                        Rec::Free(w.fence)
                    } else {
                        Rec::Absent
                    };
                    if w.phase == Phase::Effected {
                        // Released after writing: the write stays downstream.
                        s.down[k].losses += 1;
                    }
                }
            }
        }
        s.workers[i].token = 0;
        s.workers[i].fence = 0;
    }

    /// A new lease on key `k` for worker `i`: a fresh token, and the next
    /// fencing number (global for [`StoreKind::Lease`], the record's counter
    /// plus 1 for [`StoreKind::LeaseRecord`], which takes an expired lease
    /// over). `blind` is the check-then-insert flaw's unconditional overwrite,
    /// which counts no loss for a live holder it overwrites.
    fn acquire(&self, s: &mut State, i: usize, k: usize, blind: bool) {
        s.next_token += 1;
        let token = s.next_token;
        let fence = match (self.store, s.rec[k]) {
            (StoreKind::LeaseRecord, Rec::Free(f)) => f + 1,
            (
                StoreKind::LeaseRecord,
                Rec::InFlight {
                    token: old, fence, ..
                },
            ) => {
                if !blind && self.live_holder(s, k as u8, old) {
                    // Taken over from a live holder: its write may land.
                    s.down[k].losses += 1;
                }
                fence + 1
            }
            (StoreKind::LeaseRecord, _) => 1,
            _ => token,
        };
        if fence <= s.max_issued[k] {
            s.fence_reuses += 1;
        }
        s.max_issued[k] = s.max_issued[k].max(fence);
        s.rec[k] = Rec::InFlight {
            token,
            fence,
            expired: false,
        };
        s.workers[i].token = token;
        s.workers[i].fence = fence;
    }

    fn step(&self, s: &mut State, i: usize) {
        let w = s.workers[i].clone();
        let k = usize::from(w.msg);
        let bit = 1u8 << i;
        let next = match (self.store, w.phase) {
            (_, Phase::Idle) => Phase::Idle,
            // Claim.
            (StoreKind::Transactional, Phase::Received) => {
                if s.tx[k].committed {
                    Phase::Duplicate
                } else if self.flaws.check_then_insert {
                    // The SELECT cannot see another's uncommitted row.
                    Phase::Checked
                } else {
                    // INSERT … ON CONFLICT DO NOTHING; enabled only when no
                    // other transaction holds the row (else it waits).
                    s.tx[k].lockers |= bit;
                    Phase::Holding
                }
            }
            (StoreKind::Transactional, Phase::Checked) => {
                s.tx[k].lockers |= bit;
                Phase::Holding
            }
            // Lock, then look (or, the flaw, look, then lock).
            (StoreKind::PartitionedTransactional, Phase::Received) => {
                if self.looks_first() {
                    // The snapshot of the look-up, kept until the lock is granted.
                    s.workers[i].fence = u8::from(s.tx[k].committed);
                } else {
                    s.tx[k].lockers |= bit;
                }
                Phase::Checked
            }
            (StoreKind::PartitionedTransactional, Phase::Checked) => {
                let seen_done = if self.looks_first() {
                    s.tx[k].lockers |= bit;
                    s.workers[i].fence == 1
                } else {
                    s.tx[k].committed
                };
                s.workers[i].fence = 0;
                if seen_done {
                    // The duplicate's transaction ends: the lock goes.
                    s.tx[k].lockers &= !bit;
                    Phase::Duplicate
                } else {
                    Phase::Holding
                }
            }
            (StoreKind::Lease | StoreKind::LeaseRecord, Phase::Received) => match s.rec[k] {
                Rec::Done(_) => Phase::Duplicate,
                Rec::InFlight { expired: false, .. } => Phase::Retry,
                Rec::InFlight { expired: true, .. } if self.store == StoreKind::Lease => {
                    Phase::Retry
                }
                _ if self.flaws.check_then_insert => Phase::Checked,
                _ => {
                    self.acquire(s, i, k, false);
                    Phase::Holding
                }
            },
            (StoreKind::Lease | StoreKind::LeaseRecord, Phase::Checked) => {
                // The unconditional SET after the GET.
                self.acquire(s, i, k, true);
                Phase::Holding
            }
            // The handler's effect.
            (StoreKind::Transactional | StoreKind::PartitionedTransactional, Phase::Holding) => {
                Phase::Effected
            }
            (StoreKind::Lease | StoreKind::LeaseRecord, Phase::Holding) => {
                let d = &mut s.down[k];
                if !self.flaws.write_without_fencing && w.fence < d.max_fence {
                    // Refused by the downstream: the handler fails, rollback, nack.
                    self.abandon(s, i);
                    Phase::Retry
                } else {
                    if w.fence < d.max_fence || matches!(s.rec[k], Rec::Done(_)) {
                        d.stale_writes += 1;
                    }
                    d.max_fence = d.max_fence.max(w.fence);
                    d.writes += 1;
                    Phase::Effected
                }
            }
            // Ack before commit (flaw), then commit.
            (_, Phase::Effected) if self.flaws.ack_before_commit && !w.acked => {
                s.workers[i].acked = true;
                Phase::Effected
            }
            (StoreKind::Transactional | StoreKind::PartitionedTransactional, Phase::Effected) => {
                if s.tx[k].committed {
                    s.stale_completions += u8::from(s.tx[k].lockers & bit == 0);
                }
                s.tx[k].committed = true;
                s.tx[k].effects += 1;
                s.tx[k].lockers &= !bit;
                s.completions[k] += 1;
                Phase::Completed
            }
            (StoreKind::Lease | StoreKind::LeaseRecord, Phase::Effected) => {
                // Compare-and-set on the token: an expired record lease that
                // nobody took over is still this holder's.
                let holds = s.rec[k].held_by(w.token);
                if holds || self.flaws.complete_without_cas {
                    // Stale: another lease took the key over (or completed it).
                    if !holds && !matches!(s.rec[k], Rec::Absent | Rec::Free(_)) {
                        s.stale_completions += 1;
                    }
                    s.rec[k] = Rec::Done(w.fence);
                    s.completions[k] += 1;
                    Phase::Completed
                } else {
                    // LeaseLost: the engine nacks; the redelivery finds out.
                    Phase::Retry
                }
            }
            // Settle: ack, or nack (redelivery).
            (_, Phase::Completed | Phase::Duplicate) => {
                s.workers[i] = idle();
                return;
            }
            (_, Phase::Retry) => {
                if !w.acked {
                    s.ready[k] += 1;
                }
                s.workers[i] = idle();
                return;
            }
        };
        s.workers[i].phase = next;
    }
}
