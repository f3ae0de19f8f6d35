//! The per-partition bookkeeping: buffered, in-flight and retried records,
//! and the contiguous position to commit.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Instant;

use crate::error::InputError;
use crate::message::Message;

/// A record received from the broker, ready to be delivered (again).
#[derive(Debug, Clone)]
pub(super) struct Record {
    pub(super) offset: i64,
    pub(super) message: Message,
    pub(super) defect: Option<InputError>,
    /// The delivery count of its next delivery.
    pub(super) count: u32,
}

#[derive(Debug, Default)]
pub(super) struct Partition {
    /// Changes whenever the partition is (re)assigned; stale acks are ignored.
    pub(super) generation: u64,
    pub(super) buffer: VecDeque<Record>,
    /// The deliveries handed out and not yet settled: offset → record key.
    pub(super) in_flight: BTreeMap<i64, Option<String>>,
    /// Nacked records, by when to deliver them again (then offset).
    pub(super) retries: BTreeMap<(Instant, i64), Record>,
    /// The highest offset settled in this generation.
    pub(super) highest_settled: Option<i64>,
    /// The highest contiguous position (every record below it settled) not
    /// yet committed: what the next commit sends.
    pub(super) uncommitted: Option<i64>,
    /// The position last committed in this generation.
    pub(super) committed: Option<i64>,
    pub(super) paused: bool,
    /// Being revoked: nothing more is handed out.
    pub(super) revoking: bool,
    /// Records below this offset are already applied (the stored watermark
    /// the partition was positioned at): dropped if fetched anyway.
    pub(super) floor: Option<i64>,
    /// A seek to the watermark the polling thread is still to make; nothing
    /// of the partition is handed out until it is made.
    pub(super) seek_to: Option<i64>,
}

impl Partition {
    /// Whether another record may be handed out: fewer than `limit`
    /// unsettled (in flight or waiting for a retry), and nothing in the way.
    pub(super) fn open(&self, limit: usize) -> bool {
        !self.revoking && self.seek_to.is_none() && self.in_flight.len() < limit
    }

    /// The next record to hand out at `now` with at most `limit` unsettled:
    /// a retry that is due (the lowest offset first), else, if the retries
    /// still waiting leave room, the first buffered record whose record key
    /// has no earlier record unsettled (records of one key go out one at a
    /// time, in offset order; records without a key are independent).
    /// Otherwise, when the earliest retry is due.
    pub(super) fn next_record(
        &mut self,
        now: Instant,
        limit: usize,
    ) -> Result<Record, Option<Instant>> {
        let due = self
            .retries
            .iter()
            .filter(|((at, _), _)| *at <= now)
            .map(|(k, _)| *k)
            .min_by_key(|(_, offset)| *offset);
        if let Some(k) = due {
            if let Some(record) = self.retries.remove(&k) {
                return Ok(record);
            }
        }
        let waiting = self.retries.keys().next().map(|(at, _)| *at);
        if self.in_flight.len() + self.retries.len() < limit {
            let mut blocked: HashSet<&str> = self
                .in_flight
                .values()
                .flatten()
                .chain(self.retries.values().filter_map(|r| r.message.key.as_ref()))
                .map(String::as_str)
                .collect();
            let mut eligible = None;
            for (at, record) in self.buffer.iter().enumerate() {
                match record.message.key.as_deref() {
                    None => {}
                    Some(key) if !blocked.insert(key) => continue,
                    Some(_) => {}
                }
                eligible = Some(at);
                break;
            }
            if let Some(record) = eligible.and_then(|at| self.buffer.remove(at)) {
                return Ok(record);
            }
        }
        Err(waiting)
    }

    /// The partition's contiguous position if `offset` (in flight) settled
    /// now: the lowest *other* offset still unsettled (in flight, waiting
    /// for a retry, or buffered), else one past the highest settled one.
    pub(super) fn position_if_settled(&self, offset: i64) -> i64 {
        let lowest_other = self
            .in_flight
            .keys()
            .copied()
            .filter(|o| *o != offset)
            .chain(self.retries.keys().map(|(_, o)| *o))
            .chain(self.buffer.front().map(|r| r.offset))
            .min();
        let high = self.highest_settled.map_or(offset, |h| h.max(offset));
        lowest_other.map_or(high + 1, |low| low.min(high + 1))
    }

    /// Marks `offset` settled and, if the partition's contiguous position
    /// moved past what was committed, makes it the next one to commit: the
    /// lowest offset still unsettled (in flight, waiting for a retry, or
    /// still buffered behind an earlier record of its key), else one past
    /// the highest settled offset.
    pub(super) fn settle(&mut self, offset: i64) {
        let position = self.position_if_settled(offset);
        self.in_flight.remove(&offset);
        self.highest_settled = Some(self.highest_settled.map_or(offset, |h| h.max(offset)));
        let ahead = |known: Option<i64>| known.is_none_or(|k| position > k);
        if ahead(self.committed) && ahead(self.uncommitted) {
            self.uncommitted = Some(position);
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) partitions: HashMap<i32, Partition>,
    pub(super) next_generation: u64,
    pub(super) cursor: usize,
    /// Positions set in an assignment, for the partitions it creates.
    pub(super) floors: HashMap<i32, i64>,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn record(offset: i64) -> Record {
        Record {
            offset,
            message: Message::new(offset.to_string()),
            defect: None,
            count: 1,
        }
    }

    fn partition_with(offsets: std::ops::Range<i64>) -> Partition {
        Partition {
            buffer: offsets.map(record).collect(),
            ..Partition::default()
        }
    }

    /// Hands out the next record as the source does.
    fn hand_out(p: &mut Partition, limit: usize) -> Option<i64> {
        let r = p.next_record(Instant::now(), limit).ok()?;
        p.in_flight.insert(r.offset, r.message.key.clone());
        Some(r.offset)
    }

    #[test]
    fn the_position_stops_at_the_lowest_unsettled_offset() {
        let mut p = partition_with(0..4);
        for _ in 0..3 {
            hand_out(&mut p, 8);
        }
        p.settle(2);
        p.settle(1);
        assert_eq!(p.uncommitted, Some(0), "offset 0 is still in flight");
        p.committed = p.uncommitted.take();
        p.settle(0);
        assert_eq!(
            p.uncommitted,
            Some(3),
            "0..=2 settled: the next to read is 3"
        );
        hand_out(&mut p, 8);
        p.committed = p.uncommitted.take();
        // Offset 3 is nacked: it waits for its retry, and holds the position.
        p.in_flight.remove(&3);
        p.retries.insert((Instant::now(), 3), record(3));
        assert_eq!(p.uncommitted, None);
        assert_eq!(hand_out(&mut p, 8), Some(3), "the due retry goes out again");
        p.settle(3);
        assert_eq!(p.uncommitted, Some(4));
    }

    #[test]
    fn records_of_one_record_key_go_out_one_at_a_time_in_offset_order() {
        let keys = ["a", "a", "b", "a", "c"];
        let mut p = Partition {
            buffer: keys
                .iter()
                .enumerate()
                .map(|(offset, key)| {
                    let mut r = record(offset as i64);
                    r.message.key = Some((*key).to_owned());
                    r
                })
                .collect(),
            ..Partition::default()
        };
        assert_eq!(hand_out(&mut p, 8), Some(0), "a@0");
        assert_eq!(hand_out(&mut p, 8), Some(2), "b@2: a@1 waits for a@0");
        assert_eq!(hand_out(&mut p, 8), Some(4), "c@4: a@3 waits behind a@1");
        assert_eq!(hand_out(&mut p, 8), None);
        p.settle(4);
        p.settle(2);
        assert_eq!(
            p.uncommitted,
            Some(0),
            "a@0 in flight, a@1 and a@3 buffered"
        );
        p.settle(0);
        assert_eq!(
            p.uncommitted,
            Some(1),
            "a@1 is still buffered: never skipped"
        );
        assert_eq!(hand_out(&mut p, 8), Some(1), "a@1 after a@0");
        assert_eq!(hand_out(&mut p, 8), None, "a@3 waits for a@1");
        p.settle(1);
        assert_eq!(p.uncommitted, Some(3));
        assert_eq!(hand_out(&mut p, 8), Some(3));
        p.settle(3);
        assert_eq!(p.uncommitted, Some(5), "everything up to c@4 settled");
    }

    #[test]
    fn the_position_if_settled_never_passes_another_unsettled_record() {
        let mut p = partition_with(0..5);
        for _ in 0..3 {
            hand_out(&mut p, 8);
        }
        assert_eq!(p.position_if_settled(1), 0, "0 is still in flight");
        assert_eq!(p.position_if_settled(0), 1, "1 is still in flight");
        p.settle(1);
        p.settle(2);
        assert_eq!(p.position_if_settled(0), 3, "3 is buffered");
        hand_out(&mut p, 8);
        hand_out(&mut p, 8);
        p.settle(3);
        assert_eq!(p.position_if_settled(4), 0, "0 is still in flight");
        p.settle(0);
        assert_eq!(p.position_if_settled(4), 5, "everything else settled");
    }

    #[test]
    fn at_most_limit_records_of_a_partition_are_unsettled() {
        let mut p = partition_with(0..10);
        assert_eq!(hand_out(&mut p, 3), Some(0));
        assert_eq!(hand_out(&mut p, 3), Some(1));
        assert_eq!(hand_out(&mut p, 3), Some(2));
        assert!(!p.open(3), "three in flight");
        p.settle(1);
        assert!(p.open(3));
        assert_eq!(hand_out(&mut p, 3), Some(3));
    }

    #[test]
    fn with_one_at_a_time_a_waiting_retry_holds_the_partition() {
        let mut p = partition_with(0..5);
        assert_eq!(hand_out(&mut p, 1), Some(0));
        let later = Instant::now() + Duration::from_secs(60);
        p.in_flight.remove(&0);
        p.retries.insert((later, 0), record(0));
        assert!(p.open(1));
        assert_eq!(
            p.next_record(Instant::now(), 1).map(|r| r.offset),
            Err(Some(later)),
            "nothing after the record waiting for its retry"
        );
        // With room for more, later records go out meanwhile.
        assert_eq!(hand_out(&mut p, 4), Some(1));
    }
}
