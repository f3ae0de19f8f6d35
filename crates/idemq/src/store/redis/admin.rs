//! The admin side of the Redis store ([`StoreAdmin`]): prune, inspect,
//! stats, dead letters, forced release.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;

use super::{attempt_record, decode_dead_letter, map_err, parse_done, RedisStore};
use crate::error::StoreError;
use crate::store::{now_ms, ConsumerStats, DeadLetterRecord, KeyReport, StoreAdmin};

impl RedisStore {
    async fn read_dead_letters(&self, ids: &[i64]) -> Result<Vec<DeadLetterRecord>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.keys.dlq("data")).arg(ids);
        let values: Vec<Option<String>> = self.query(&cmd).await?;
        Ok(ids
            .iter()
            .zip(values)
            .filter_map(|(id, v)| v.and_then(|v| decode_dead_letter(*id, &v)))
            .collect())
    }

    async fn dead_letter_ids(
        &self,
        zset: &str,
        after_id: i64,
        limit: Option<u32>,
    ) -> Result<Vec<i64>, StoreError> {
        let mut cmd = redis::cmd("ZRANGEBYSCORE");
        cmd.arg(zset).arg(format!("({after_id}")).arg("+inf");
        if let Some(limit) = limit {
            cmd.arg("LIMIT").arg(0).arg(limit);
        }
        self.query(&cmd).await
    }

    /// Removes index entries whose record is gone; returns the members kept.
    async fn drop_stale(
        &self,
        index: &str,
        members: Vec<String>,
        consumer: &str,
        suffix: &str,
        zset: bool,
    ) -> Result<usize, StoreError> {
        let mut kept = 0;
        for member in members {
            let mut exists = redis::cmd("EXISTS");
            exists.arg(self.keys.scoped(consumer, &member, suffix));
            let n: i64 = self.query(&exists).await?;
            if n > 0 {
                kept += 1;
            } else {
                let mut rm = redis::cmd(if zset { "ZREM" } else { "SREM" });
                rm.arg(index).arg(&member);
                let _: i64 = self.query(&rm).await?;
            }
        }
        Ok(kept)
    }
}

#[async_trait]
impl StoreAdmin for RedisStore {
    async fn ping(&self) -> Result<(), StoreError> {
        let _: String = self.query(&redis::cmd("PING")).await?;
        Ok(())
    }

    /// Redis needs no schema: a no-op success.
    async fn migrate(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Deletes done records first seen before `cutoff_ms`, found through the
    /// per-consumer index (records also expire by their retention TTL);
    /// returns how many index entries were handled, at most `batch`.
    async fn prune_batch(&self, cutoff_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let mut consumers: Vec<String> = self
            .query(redis::cmd("SMEMBERS").arg(self.keys.consumers()))
            .await?;
        consumers.sort();
        let mut handled: u64 = 0;
        for consumer in consumers {
            let left = u64::from(batch).saturating_sub(handled);
            if left == 0 {
                break;
            }
            let index = self.keys.consumer(&consumer, "done");
            let members: Vec<String> = self
                .query(
                    redis::cmd("ZRANGEBYSCORE")
                        .arg(&index)
                        .arg("-inf")
                        .arg(format!("({cutoff_ms}"))
                        .arg("LIMIT")
                        .arg(0)
                        .arg(left),
                )
                .await?;
            for member in members {
                let _: i64 = self
                    .scripts
                    .prune
                    .key(self.keys.scoped(&consumer, &member, "rec"))
                    .key(self.keys.scoped(&consumer, &member, "fx"))
                    .invoke_async(&mut self.conn())
                    .await
                    .map_err(map_err)?;
                let _: i64 = self
                    .query(redis::cmd("ZREM").arg(&index).arg(&member))
                    .await?;
                handled += 1;
            }
        }
        Ok(handled)
    }

    async fn inspect(&self, consumer: &str, key: &str) -> Result<KeyReport, StoreError> {
        let rec_key = self.keys.scoped(consumer, key, "rec");
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(&rec_key).cmd("PTTL").arg(&rec_key);
        let (rec, pttl): (Option<String>, i64) =
            pipe.query_async(&mut self.conn()).await.map_err(map_err)?;
        let (inbox, in_flight) = match rec.as_deref() {
            Some(v) if v.starts_with("done:") => (parse_done(consumer, key, &v[5..]), false),
            Some(v) => (None, lease_live(v, now_ms(), pttl)),
            None => (None, false),
        };
        let att: HashMap<String, String> = self
            .query(redis::cmd("HGETALL").arg(self.keys.scoped(consumer, key, "att")))
            .await?;
        let ids = self
            .dead_letter_ids(&self.keys.dlq_key(consumer, key), 0, None)
            .await?;
        Ok(KeyReport {
            inbox,
            in_flight,
            attempts: attempt_record(&att),
            dead_letters: self.read_dead_letters(&ids).await?,
        })
    }

    async fn stats(&self) -> Result<Vec<ConsumerStats>, StoreError> {
        let mut consumers: Vec<String> = self
            .query(redis::cmd("SMEMBERS").arg(self.keys.consumers()))
            .await?;
        consumers.sort();
        let horizon = now_ms()
            .saturating_sub(i64::try_from(self.options.retention.as_millis()).unwrap_or(i64::MAX));
        let mut out = Vec::new();
        for consumer in consumers {
            let done = self.keys.consumer(&consumer, "done");
            // Entries older than the retention window may have expired.
            let old: Vec<String> = self
                .query(
                    redis::cmd("ZRANGEBYSCORE")
                        .arg(&done)
                        .arg("-inf")
                        .arg(format!("({horizon}")),
                )
                .await?;
            self.drop_stale(&done, old, &consumer, "rec", true).await?;
            let processed: u64 = self.query(redis::cmd("ZCARD").arg(&done)).await?;
            let first: Vec<(String, f64)> = self
                .query(
                    redis::cmd("ZRANGE")
                        .arg(&done)
                        .arg(0)
                        .arg(0)
                        .arg("WITHSCORES"),
                )
                .await?;
            let last: Vec<(String, f64)> = self
                .query(
                    redis::cmd("ZRANGE")
                        .arg(&done)
                        .arg(-1)
                        .arg(-1)
                        .arg("WITHSCORES"),
                )
                .await?;
            let failing_key = self.keys.consumer(&consumer, "failing");
            let failing: Vec<String> = self.query(redis::cmd("SMEMBERS").arg(&failing_key)).await?;
            let failing = self
                .drop_stale(&failing_key, failing, &consumer, "att", false)
                .await? as u64;
            let dead_letters: u64 = self
                .query(redis::cmd("ZCARD").arg(self.keys.dlq_consumer(&consumer)))
                .await?;
            if processed == 0 && failing == 0 && dead_letters == 0 {
                continue;
            }
            out.push(ConsumerStats {
                consumer,
                processed,
                oldest_ms: first.first().map(|(_, s)| *s as i64),
                newest_ms: last.first().map(|(_, s)| *s as i64),
                dead_letters,
                failing,
            });
        }
        Ok(out)
    }

    async fn dead_letters(
        &self,
        consumer: Option<&str>,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<DeadLetterRecord>, StoreError> {
        let zset = match consumer {
            Some(c) => self.keys.dlq_consumer(c),
            None => self.keys.dlq("ids"),
        };
        let ids = self.dead_letter_ids(&zset, after_id, Some(limit)).await?;
        self.read_dead_letters(&ids).await
    }

    async fn delete_dead_letter(&self, id: i64) -> Result<bool, StoreError> {
        let Some(record) = self.read_dead_letters(&[id]).await?.pop() else {
            return Ok(false);
        };
        let mut invocation = self.scripts.delete_dead_letter.prepare_invoke();
        invocation
            .key(self.keys.dlq("data"))
            .key(self.keys.dlq("ids"))
            .key(self.keys.dlq_consumer(&record.consumer))
            .key(self.keys.dlq("letters"))
            .key(self.keys.dlq("letter_of"));
        if let Some(key) = &record.key {
            invocation.key(self.keys.dlq_key(&record.consumer, key));
        }
        let n: i64 = invocation
            .arg(id)
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(n == 1)
    }

    /// Frees the key's record if it is in flight (whatever its token; the
    /// fencing counter stays), so the next claim takes the key at once with
    /// a higher fencing number; the old holder's completion is
    /// then refused ([`StoreErrorKind::LeaseLost`](crate::StoreErrorKind::LeaseLost)) and its heartbeat reports
    /// the loss.
    async fn release(&self, consumer: &str, key: &str) -> Result<bool, StoreError> {
        let n: i64 = self
            .scripts
            .force_release
            .key(self.keys.scoped(consumer, key, "rec"))
            .arg(self.record_ttl(Duration::ZERO))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(n == 1)
    }
}

/// Whether the record `v` (whose remaining TTL is `pttl_ms`) is a lease
/// whose deadline has not passed: `in-flight:<token>:<fence>:<deadline>:<first
/// seen>` with the deadline in ms (judged by this machine's clock), or
/// `~<lease ms>/<TTL ms>`, a lease of `<lease ms>` from when the record was
/// written with that TTL. A record of the previous layout
/// (`in-flight:<token>`, expiring with its lease) is live while it exists.
/// A free record is not.
fn lease_live(v: &str, now_ms: i64, pttl_ms: i64) -> bool {
    let Some(rest) = v.strip_prefix("in-flight:") else {
        return false;
    };
    let fields: Vec<&str> = rest.split(':').collect();
    let [_, _, deadline, _] = fields.as_slice() else {
        return true;
    };
    if let Some(relative) = deadline.strip_prefix('~') {
        let Some((lease, ttl)) = relative.split_once('/') else {
            return true;
        };
        return match (lease.parse::<i64>(), ttl.parse::<i64>()) {
            (Ok(lease), Ok(ttl)) => ttl - pttl_ms < lease,
            _ => true,
        };
    }
    deadline.parse::<i64>().map_or(true, |d| d > now_ms)
}

#[cfg(test)]
mod tests {
    use super::lease_live;

    #[test]
    fn a_lease_is_live_until_its_deadline() {
        assert!(lease_live("in-flight:ab1:1700000000000:2000:1000", 1999, 9));
        assert!(!lease_live(
            "in-flight:ab1:1700000000000:2000:1000",
            2000,
            9
        ));
        // Written with a 100 000 ms TTL and a 30 000 ms lease.
        let relative = "in-flight:ab1:1700000000000:~30000/100000:1000";
        assert!(lease_live(relative, 0, 70_001), "29 999 ms after the write");
        assert!(
            !lease_live(relative, 0, 70_000),
            "30 000 ms after the write"
        );
        assert!(lease_live("in-flight:0123abcd", 5_000, 9));
        assert!(!lease_live("free:17:1000", 0, 9));
        assert!(!lease_live("done:{}", 0, 9));
    }
}
