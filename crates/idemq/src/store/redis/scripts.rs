//! The Lua scripts of the lease protocol, the admin side and the effect
//! journal.

use std::time::Duration;

use redis::Script;

const CLAIM: &str = r#"
local v = redis.call('GET', KEYS[1])
if v then
  if string.sub(v, 1, 5) == 'done:' then return {'done', string.sub(v, 6)} end
  return {'busy'}
end
redis.call('SET', KEYS[1], 'in-flight:' .. ARGV[1], 'NX', 'PX', ARGV[2])
local n = redis.call('HINCRBY', KEYS[2], 'n', 1)
redis.call('HSETNX', KEYS[2], 'first_seen', ARGV[3])
local fs = redis.call('HGET', KEYS[2], 'first_seen')
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {'new', tostring(n), fs}
"#;

const EXTEND: &str = r#"
if redis.call('GET', KEYS[1]) == 'in-flight:' .. ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"#;

const COMPLETE: &str = r#"
if redis.call('GET', KEYS[1]) ~= 'in-flight:' .. ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HDEL', KEYS[2], 'first_seen')
redis.call('DEL', KEYS[3])
return 1
"#;

/// [`COMPLETE`] and, when it succeeds, the admin indexes of the completed
/// key in the same script (one Redis only: the index keys are in other
/// slots than the key's records). KEYS: rec, fence, att, the consumer's
/// done index, its failing set, the set of consumers; ARGV: token, done
/// value, retention ms, first-seen ms, key, retention horizon ms, consumer.
const COMPLETE_INDEXED: &str = r#"
if redis.call('GET', KEYS[1]) ~= 'in-flight:' .. ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HDEL', KEYS[2], 'first_seen')
redis.call('DEL', KEYS[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[5])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[6])
redis.call('SREM', KEYS[5], ARGV[5])
redis.call('SADD', KEYS[6], ARGV[7])
return 1
"#;

pub(super) const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == 'in-flight:' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

const FAIL: &str = r#"
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'last_error', ARGV[1], 'last_failed', ARGV[2])
redis.call('HSETNX', KEYS[1], 'first_failed', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return n
"#;

/// KEYS: seq, data, ids, consumer's ids, letters (letter id → id),
/// letter_of (id → letter id)[, key's ids]; ARGV: the letter's JSON, its
/// letter id. A letter id stored already returns the stored id and writes
/// nothing (one letter per dead-lettered message).
const DEAD_LETTER: &str = r#"
local seen = redis.call('HGET', KEYS[5], ARGV[2])
if seen then return tonumber(seen) end
local id = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], id, ARGV[1])
redis.call('ZADD', KEYS[3], id, id)
redis.call('ZADD', KEYS[4], id, id)
redis.call('HSET', KEYS[5], ARGV[2], id)
redis.call('HSET', KEYS[6], id, ARGV[2])
if KEYS[7] then redis.call('ZADD', KEYS[7], id, id) end
return id
"#;

/// KEYS: data, ids, consumer's ids, letters, letter_of[, key's ids]; ARGV: id.
const DELETE_DEAD_LETTER: &str = r#"
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
local letter = redis.call('HGET', KEYS[5], ARGV[1])
if letter then
  redis.call('HDEL', KEYS[4], letter)
  redis.call('HDEL', KEYS[5], ARGV[1])
end
if KEYS[6] then redis.call('ZREM', KEYS[6], ARGV[1]) end
return 1
"#;

const FORCE_RELEASE: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 10) == 'in-flight:' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

const PRUNE: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 5) == 'done:' then
  redis.call('DEL', KEYS[1])
  if KEYS[2] then redis.call('DEL', KEYS[2]) end
  return 1
end
return 0
"#;

const EFFECT_PUT: &str = r#"
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return redis.call('HGET', KEYS[1], ARGV[1])
"#;

#[derive(Debug)]
pub(super) struct Scripts {
    pub(super) claim: Script,
    pub(super) extend: Script,
    pub(super) complete: Script,
    pub(super) complete_indexed: Script,
    pub(super) release: Script,
    pub(super) fail: Script,
    pub(super) dead_letter: Script,
    pub(super) delete_dead_letter: Script,
    pub(super) prune: Script,
    pub(super) force_release: Script,
    pub(super) effect_put: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            claim: Script::new(CLAIM),
            extend: Script::new(EXTEND),
            complete: Script::new(COMPLETE),
            complete_indexed: Script::new(COMPLETE_INDEXED),
            release: Script::new(RELEASE),
            fail: Script::new(FAIL),
            dead_letter: Script::new(DEAD_LETTER),
            delete_dead_letter: Script::new(DELETE_DEAD_LETTER),
            prune: Script::new(PRUNE),
            force_release: Script::new(FORCE_RELEASE),
            effect_put: Script::new(EFFECT_PUT),
        }
    }
}

pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
