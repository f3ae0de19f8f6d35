//! Entries removed from the stream before the consumer group read them
//! (loss the broker causes, see [`crate::source::loss`]).
//!
//! Redis has no retention setting to read: producers trim
//! (`XADD … MAXLEN|MINID`), anyone can `XTRIM` or `XDEL`. What Redis 7
//! reports instead is what was removed, and this module compares it with
//! how far the group has read. From `XINFO STREAM` ([`StreamState`]) and
//! the group's row of `XINFO GROUPS` ([`GroupState`]), read together in one
//! `MULTI`, with L the group's `last-delivered-id`:
//!
//! - **Deleted**: `max-deleted-entry-id` > L. An entry the group has not
//!   been given was deleted (`XDEL`; Redis 7.0 does not move this mark when
//!   it trims). Exact: `XREADGROUP >` only hands out ids above L.
//! - **Trimmed**: the stream now starts above L (its first entry, or its
//!   `last-generated-id` when it is empty). Every entry up to L is then
//!   gone, so the entries removed above L number
//!   `entries-added − length − counter(L)`, where counter(L), the entries
//!   added up to L, is the group's `entries-read` (0 when L is `0-0`). When
//!   that is more than 0, those entries were trimmed unread: lost. With no
//!   `entries-read` (a group created outside idemq at an id or at `$`, not
//!   read from since) the count is unknown and nothing is said.
//! - **Skipped** (while running only): the group is caught up (L is the
//!   stream's `last-generated-id`) and its `lag` is still above 0. Redis
//!   counts `entries-read` up by one per entry delivered, so after the
//!   group read past a gap its `lag` keeps the gap's size: entries the group
//!   never received. This catches a trim that the group read past between
//!   two readings.
//!
//! Redis before 7 reports neither `max-deleted-entry-id` nor
//! `entries-added`: nothing is checked there.
//!
//! # A group idemq creates
//!
//! `start=0` means "every entry the stream has", not entries trimmed
//! before the group existed: those are no consumer's loss. So when the
//! stream's head was trimmed before, idemq creates the group just below the
//! first entry with `ENTRIESREAD` set to the entries removed
//! ([`creation`]); an empty stream that had entries, or `start=$`, at its
//! `last-generated-id` with `ENTRIESREAD` = `entries-added`. The group then
//! has an exact counter from the start and nothing before it counts as
//! lost, now or after a restart. A stream whose removed entries are not all
//! below its first entry (an `XDEL` among the entries it has) gets the group
//! at `0`; the source that created it does not apply the policy to what it
//! found then, but a restart before the group read past the deleted id is
//! refused (`broker_loss=warn` runs it).
//!
//! The count of a *trimmed* finding includes the entries the group skipped
//! in an earlier loss (its `entries-read` counts deliveries, not ids), so
//! after one loss a later one can read larger than it is.

use std::collections::HashMap;
use std::fmt;

use redis::streams::StreamInfoGroup;
use redis::Value;

use crate::source::loss::LossRisk;

/// A stream entry id, `<ms>-<seq>`, ordered as Redis orders them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct StreamId {
    /// The milliseconds part.
    ms: u64,
    /// The sequence part.
    seq: u64,
}

impl StreamId {
    /// `0-0`, below every entry.
    pub(super) const ZERO: Self = Self { ms: 0, seq: 0 };

    /// Parses `<ms>-<seq>` (or `<ms>`, sequence 0).
    pub(super) fn parse(text: &str) -> Option<Self> {
        let (ms, seq) = text.split_once('-').unwrap_or((text, "0"));
        Some(Self {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }

    /// The greatest id below this one (`0-0` stays `0-0`).
    pub(super) fn before(self) -> Self {
        match (self.ms, self.seq) {
            (ms, seq) if seq > 0 => Self { ms, seq: seq - 1 },
            (0, _) => Self::ZERO,
            (ms, _) => Self {
                ms: ms - 1,
                seq: u64::MAX,
            },
        }
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// What `XINFO STREAM` tells of the stream's removed entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct StreamState {
    /// The id of the first entry; `None` when the stream is empty.
    pub(super) first_entry: Option<StreamId>,
    /// The id of the last entry ever added.
    pub(super) last_generated: StreamId,
    /// The greatest id deleted (`XDEL`), `0-0` if none.
    pub(super) max_deleted: StreamId,
    /// Entries ever added.
    pub(super) entries_added: u64,
    /// Entries the stream has now.
    pub(super) length: u64,
}

/// A number in a reply (an integer, or its text).
fn number(value: &Value) -> Option<u64> {
    match value {
        Value::Int(n) => u64::try_from(*n).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// An id in a reply.
fn id(value: &Value) -> Option<StreamId> {
    match value {
        Value::BulkString(b) => StreamId::parse(std::str::from_utf8(b).ok()?),
        Value::SimpleString(s) => StreamId::parse(s),
        _ => None,
    }
}

impl StreamState {
    /// Reads an `XINFO STREAM` reply (RESP2 or RESP3); `None` when it lacks
    /// what Redis 7 reports (`max-deleted-entry-id`, `entries-added`).
    pub(super) fn parse(reply: Value) -> Option<Self> {
        let info: HashMap<String, Value> = redis::from_redis_value(reply).ok()?;
        let first_entry = match info.get("first-entry")? {
            Value::Array(entry) => Some(id(entry.first()?)?),
            _ => None,
        };
        Some(Self {
            first_entry,
            last_generated: id(info.get("last-generated-id")?)?,
            max_deleted: id(info.get("max-deleted-entry-id")?)?,
            entries_added: number(info.get("entries-added")?)?,
            length: number(info.get("length")?)?,
        })
    }

    /// Where the stream starts now: its first entry, or past its last
    /// generated id when it is empty. Entries below are gone.
    fn starts_above(&self, id: StreamId) -> bool {
        match self.first_entry {
            Some(first) => id < first,
            None => id < self.last_generated,
        }
    }

    /// Entries removed from the stream (trimmed or deleted).
    fn removed(&self) -> u64 {
        self.entries_added.saturating_sub(self.length)
    }
}

/// What `XINFO GROUPS` tells of one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct GroupState {
    /// The last id delivered to the group.
    pub(super) last_delivered: StreamId,
    /// The entries added up to `last_delivered` as Redis counts them, when
    /// it knows.
    pub(super) entries_read: Option<u64>,
    /// Entries not delivered to the group yet, when Redis can tell.
    pub(super) lag: Option<u64>,
}

impl GroupState {
    /// From the group's row of `XINFO GROUPS`; `None` if its id is not one.
    pub(super) fn from_info(group: &StreamInfoGroup) -> Option<Self> {
        Some(Self {
            last_delivered: StreamId::parse(&group.last_delivered_id)?,
            entries_read: group.entries_read.and_then(|n| u64::try_from(n).ok()),
            lag: group.lag.and_then(|n| u64::try_from(n).ok()),
        })
    }
}

/// Entries the group lost before reading them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Loss {
    /// Entries above the group's last delivered id were deleted, up to
    /// `up_to` (`max-deleted-entry-id`).
    Deleted {
        /// The group's last delivered id.
        after: StreamId,
        /// The stream's `max-deleted-entry-id`.
        up_to: StreamId,
    },
    /// `count` entries above the group's last delivered id were trimmed;
    /// the stream now starts at `first` (`None`: it is empty, up to
    /// `last_generated`).
    Trimmed {
        /// The group's last delivered id.
        after: StreamId,
        /// The stream's first entry now.
        first: Option<StreamId>,
        /// The stream's last generated id.
        last_generated: StreamId,
        /// How many.
        count: u64,
    },
    /// The group, caught up, never received `count` entries: removed
    /// before it read them, and read past since.
    Skipped {
        /// How many.
        count: u64,
    },
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Deleted { after, up_to } => write!(
                f,
                "entries after the group's last-delivered-id {after}, up to max-deleted-entry-id {up_to}, were deleted before the group read them"
            ),
            Self::Trimmed {
                after,
                first: Some(first),
                count,
                ..
            } => write!(
                f,
                "{count} entries after the group's last-delivered-id {after} and before the stream's first entry {first} were trimmed before the group read them"
            ),
            Self::Trimmed {
                after,
                first: None,
                last_generated,
                count,
            } => write!(
                f,
                "{count} entries after the group's last-delivered-id {after}, up to {last_generated}, were trimmed before the group read them (the stream is empty)"
            ),
            Self::Skipped { count } => write!(
                f,
                "the group never received {count} entries: they were removed before it read them"
            ),
        }
    }
}

/// The entries the stream removed above the group's last delivered id,
/// when the stream now starts above it and the group's counter is known.
fn trimmed(stream: &StreamState, group: &GroupState) -> Option<u64> {
    let after = group.last_delivered;
    if !stream.starts_above(after) {
        return None;
    }
    let counter = match group.entries_read {
        Some(n) => n,
        None if after == StreamId::ZERO => 0,
        None => return None,
    };
    Some(stream.removed().saturating_sub(counter))
}

/// What the group has lost and not read past yet: what connecting checks.
pub(super) fn unread_losses(stream: &StreamState, group: &GroupState) -> Vec<Loss> {
    let after = group.last_delivered;
    let mut found = Vec::new();
    if stream.max_deleted > after {
        found.push(Loss::Deleted {
            after,
            up_to: stream.max_deleted,
        });
    }
    if let Some(count) = trimmed(stream, group).filter(|n| *n > 0) {
        found.push(Loss::Trimmed {
            after,
            first: stream.first_entry,
            last_generated: stream.last_generated,
            count,
        });
    }
    found
}

/// What to do instead, in every risk.
pub(super) const REMEDY: &str = "trim only below the group's last delivered id (XTRIM MINID <last-delivered-id>) and below its oldest pending entry (XPENDING), or not at all";

/// The [`LossRisk`]s of `losses` of `group` on `stream`.
pub(super) fn risks(stream: &str, group: &str, losses: &[Loss]) -> Vec<LossRisk> {
    losses
        .iter()
        .map(|loss| LossRisk {
            place: format!("stream {stream}, group {group}"),
            setting: loss.to_string(),
            effect: "and are lost".into(),
            remedy: REMEDY.into(),
        })
        .collect()
}

/// How the source creates its group: the id and, when known, the
/// `ENTRIESREAD` counter (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Creation {
    /// The id the group starts after (`0`, `$` or an entry id).
    pub(super) id: String,
    /// `ENTRIESREAD`, the entries added up to `id`.
    pub(super) entries_read: Option<u64>,
}

/// Where a group created with `start` (`0` or `$`) starts on a stream in
/// `stream` (`None`: no such stream, or Redis before 7).
pub(super) fn creation(start: &str, stream: Option<&StreamState>) -> Creation {
    let given = Creation {
        id: start.to_owned(),
        entries_read: None,
    };
    let Some(s) = stream else {
        return given;
    };
    let at_end = Creation {
        id: s.last_generated.to_string(),
        entries_read: Some(s.entries_added),
    };
    if start == "$" {
        return at_end;
    }
    if s.removed() == 0 {
        return given;
    }
    match s.first_entry {
        None => at_end,
        Some(first) if s.max_deleted < first => Creation {
            id: first.before().to_string(),
            entries_read: Some(s.removed()),
        },
        Some(_) => given,
    }
}

/// What the source has found so far while running, so that each loss is
/// logged once: the highest `max-deleted-entry-id` and the entries found
/// lost by count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Watch {
    /// The highest `max-deleted-entry-id` seen.
    deleted: StreamId,
    /// The entries lost by the last count (trimmed unread, or skipped).
    lost: u64,
}

/// The entries lost by count: trimmed above the group's last delivered id,
/// or, caught up, its lag.
fn lost(stream: &StreamState, group: &GroupState) -> Option<(u64, bool)> {
    if let Some(n) = trimmed(stream, group) {
        return Some((n, true));
    }
    (group.last_delivered == stream.last_generated)
        .then_some(group.lag)
        .flatten()
        .map(|n| (n, false))
}

impl Watch {
    /// Starts from what connecting found (already refused, warned about,
    /// or from before the group existed).
    pub(super) fn new(stream: &StreamState, group: &GroupState) -> Self {
        Self {
            deleted: stream.max_deleted,
            lost: lost(stream, group).map_or(0, |(n, _)| n),
        }
    }

    /// What a new reading shows that was not seen before.
    pub(super) fn observe(&mut self, stream: &StreamState, group: &GroupState) -> Vec<Loss> {
        let after = group.last_delivered;
        let mut found = Vec::new();
        if stream.max_deleted > after && stream.max_deleted > self.deleted {
            found.push(Loss::Deleted {
                after,
                up_to: stream.max_deleted,
            });
        }
        self.deleted = self.deleted.max(stream.max_deleted);
        if let Some((total, behind)) = lost(stream, group) {
            if total > self.lost {
                let count = total - self.lost;
                found.push(if behind {
                    Loss::Trimmed {
                        after,
                        first: stream.first_entry,
                        last_generated: stream.last_generated,
                        count,
                    }
                } else {
                    Loss::Skipped { count }
                });
            }
            // Lower: Redis counted the group afresh (XGROUP SETID, or after
            // a deletion); count from there.
            self.lost = total;
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(text: &str) -> StreamId {
        StreamId::parse(text).unwrap()
    }

    /// 300 entries `1000-1` … `1000-300`, trimmed to the last `length`.
    fn stream(length: u64) -> StreamState {
        StreamState {
            first_entry: (length > 0).then(|| id(&format!("1000-{}", 301 - length))),
            last_generated: id("1000-300"),
            max_deleted: StreamId::ZERO,
            entries_added: 300,
            length,
        }
    }

    fn group(last: &str, entries_read: Option<u64>, lag: Option<u64>) -> GroupState {
        GroupState {
            last_delivered: id(last),
            entries_read,
            lag,
        }
    }

    #[test]
    fn parses_xinfo_stream() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let reply = |first: Value, deleted: Option<&str>| {
            let mut items = vec![
                bulk("length"),
                Value::Int(50),
                bulk("last-generated-id"),
                bulk("1000-300"),
                bulk("entries-added"),
                Value::Int(300),
                bulk("first-entry"),
                first,
            ];
            if let Some(d) = deleted {
                items.extend([bulk("max-deleted-entry-id"), bulk(d)]);
            }
            Value::Array(items)
        };
        let entry = Value::Array(vec![
            bulk("1000-251"),
            Value::Array(vec![bulk("payload"), bulk("{}")]),
        ]);
        assert_eq!(
            StreamState::parse(reply(entry.clone(), Some("0-0"))),
            Some(stream(50))
        );
        let empty = StreamState::parse(reply(Value::Nil, Some("0-0"))).unwrap();
        assert_eq!(empty.first_entry, None);
        // Redis 6: no max-deleted-entry-id.
        assert_eq!(StreamState::parse(reply(entry, None)), None);
    }

    #[test]
    fn ids_compare_as_numbers_and_step_back() {
        assert!(id("9-5") < id("10-0"));
        assert!(id("10-2") < id("10-10"));
        assert_eq!(id("10"), id("10-0"));
        assert_eq!(id("10-3").before(), id("10-2"));
        assert_eq!(id("10-0").before().to_string(), "9-18446744073709551615");
        assert_eq!(StreamId::ZERO.before(), StreamId::ZERO);
        assert_eq!(StreamId::parse("x-1"), None);
        assert_eq!(StreamId::parse("1-"), None);
    }

    #[test]
    fn entries_trimmed_above_the_last_delivered_id_are_lost() {
        // A new group (0-0, no entries-read), 250 of 300 trimmed.
        let lost = unread_losses(&stream(50), &group("0-0", None, Some(50)));
        assert_eq!(
            lost,
            vec![Loss::Trimmed {
                after: StreamId::ZERO,
                first: Some(id("1000-251")),
                last_generated: id("1000-300"),
                count: 250
            }]
        );
        let text = risks("payments", "billing", &lost)[0].to_string();
        assert!(text.contains("stream payments, group billing: 250 entries after the group's last-delivered-id 0-0 and before the stream's first entry 1000-251 were trimmed"), "{text}");
        assert!(text.contains("XTRIM MINID <last-delivered-id>"), "{text}");
        // The group had read 100: 150 lost.
        let lost = unread_losses(&stream(50), &group("1000-100", Some(100), Some(200)));
        assert!(matches!(lost[..], [Loss::Trimmed { count: 150, .. }]));
        // Trimmed up to the group's last delivered id (XTRIM MINID): nothing lost.
        assert!(unread_losses(&stream(200), &group("1000-101", Some(101), None)).is_empty());
        // Trimmed exactly through it: nothing lost either.
        assert!(unread_losses(&stream(200), &group("1000-100", Some(100), None)).is_empty());
        // Emptied: everything above the group's id.
        let lost = unread_losses(&stream(0), &group("1000-100", Some(100), None));
        assert!(matches!(
            lost[..],
            [Loss::Trimmed {
                first: None,
                count: 200,
                ..
            }]
        ));
        // A counter Redis does not know: nothing said.
        assert!(unread_losses(&stream(50), &group("1000-100", None, None)).is_empty());
    }

    #[test]
    fn a_deletion_above_the_last_delivered_id_is_lost() {
        let deleted = StreamState {
            max_deleted: id("1000-280"),
            length: 299,
            ..stream(300)
        };
        let lost = unread_losses(&deleted, &group("1000-100", Some(100), None));
        assert_eq!(
            lost,
            vec![Loss::Deleted {
                after: id("1000-100"),
                up_to: id("1000-280")
            }]
        );
        assert!(unread_losses(&deleted, &group("1000-280", Some(280), None)).is_empty());
    }

    #[test]
    fn a_group_is_created_below_the_first_entry_left() {
        assert_eq!(creation("0", None).id, "0");
        assert_eq!(creation("$", None).id, "$");
        assert_eq!(creation("0", Some(&stream(300))).id, "0");
        let trimmed = creation("0", Some(&stream(50)));
        assert_eq!(
            trimmed,
            Creation {
                id: "1000-250".into(),
                entries_read: Some(250)
            }
        );
        // Created there, the group has lost nothing.
        let fresh = group(&trimmed.id, trimmed.entries_read, Some(50));
        assert!(unread_losses(&stream(50), &fresh).is_empty());
        assert_eq!(
            creation("0", Some(&stream(0))),
            Creation {
                id: "1000-300".into(),
                entries_read: Some(300)
            }
        );
        assert_eq!(creation("$", Some(&stream(50))).entries_read, Some(300));
        let holed = StreamState {
            max_deleted: id("1000-260"),
            length: 49,
            ..stream(50)
        };
        assert_eq!(creation("0", Some(&holed)).id, "0");
    }

    #[test]
    fn the_watch_reports_each_loss_once() {
        let mut watch = Watch::new(&stream(300), &group("1000-100", Some(100), Some(200)));
        assert!(watch
            .observe(&stream(300), &group("1000-200", Some(200), Some(100)))
            .is_empty());
        // Trimmed to 50 while the group is at 200: 50 lost, said once.
        let behind = group("1000-200", Some(200), Some(100));
        assert!(matches!(
            watch.observe(&stream(50), &behind)[..],
            [Loss::Trimmed { count: 50, .. }]
        ));
        assert!(watch.observe(&stream(50), &behind).is_empty());
        // Read past the gap (entries-read counts 50 fewer): still said once.
        let caught_up = group("1000-300", Some(250), Some(50));
        assert!(watch.observe(&stream(50), &caught_up).is_empty());
        // A trim read past between two readings shows as the lag of a caught-up group.
        let mut watch = Watch::new(&stream(300), &group("1000-100", Some(100), Some(200)));
        assert_eq!(
            watch.observe(&stream(50), &caught_up),
            vec![Loss::Skipped { count: 50 }]
        );
        // A deletion: said once per new max-deleted-entry-id.
        let deleted = |max: &str| StreamState {
            max_deleted: id(max),
            ..stream(300)
        };
        let mut watch = Watch::new(&stream(300), &group("1000-100", Some(100), None));
        let at = group("1000-100", Some(100), None);
        assert_eq!(watch.observe(&deleted("1000-150"), &at).len(), 1);
        assert!(watch.observe(&deleted("1000-150"), &at).is_empty());
        assert_eq!(watch.observe(&deleted("1000-160"), &at).len(), 1);
        assert!(watch.observe(&deleted("1000-50"), &at).is_empty());
    }
}
