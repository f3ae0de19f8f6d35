//! The Lua scripts of the lease protocol, the admin side and the effect
//! journal.

use std::time::Duration;

use redis::Script;

/// The Redis server's clock in milliseconds, as a Lua prelude (`now`).
/// Lease deadlines are judged by this one clock, never a client's.
macro_rules! lua_now {
    () => {
        "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
    };
}
pub(super) use lua_now;

/// Lua helpers shared by the record scripts: the record of a lease is
/// `in-flight:<token>:<fence>:<deadline>:<first seen ms>`, a released key
/// `free:<fence>:<first seen ms>`, a completed one `done:<json>`. The
/// deadline is the server's clock in ms, or `~<lease ms>/<TTL ms>` when the
/// claim was the plain `SET … NX GET PX <TTL>` of a key without a record
/// (the client does not know the server's clock): the lease then ends
/// `<lease ms>` after that write, which the record's remaining TTL tells
/// (`PTTL`), again by the server's clock. `num`
/// prints a number without Lua's exponent notation (`%d`: Redis's Lua
/// formats it as a 64-bit integer, cheaper than `%.0f`); `holds` is the
/// completion's compare on the token, `held` also parses the lease.
macro_rules! lua_record {
    () => {
        r#"
local function num(n) return string.format('%d', n) end
local function holds(v, token)
  if not v then return false end
  local p = 'in-flight:' .. token .. ':'
  return string.sub(v, 1, #p) == p
end
local function held(v, token)
  if not v then return nil end
  local p = 'in-flight:' .. token .. ':'
  if string.sub(v, 1, #p) ~= p then return nil end
  local f, d, fs = string.match(string.sub(v, #p + 1), '^(%d+):([^:]+):(%d+)$')
  return f, d, fs
end
local function deadline(rec, d, now)
  if string.sub(d, 1, 1) ~= '~' then return tonumber(d) or 0 end
  local lease, ttl = string.match(d, '^~(%d+)/(%d+)$')
  local left = redis.call('PTTL', rec)
  if not lease or left < 0 then return 0 end
  return now - (tonumber(ttl) - left) + tonumber(lease)
end
local function claim(rec, v, token, now, lease, ttl)
  local fence, first = 0, now
  if v then
    local kind = string.sub(v, 1, 5)
    if kind == 'done:' then return {'done', string.sub(v, 6)} end
    if kind == 'in-fl' then
      local f, d, fs = string.match(v, '^in%-flight:[^:]*:(%d+):([^:]+):(%d+)$')
      if not f or deadline(rec, d, now) > now then return {'busy'} end
      fence, first = tonumber(f), tonumber(fs)
    elseif kind == 'free:' then
      local f, fs = string.match(v, '^free:(%d+):(%d+)$')
      fence, first = tonumber(f) or 0, tonumber(fs) or now
    end
  end
  fence = math.max(fence + 1, now)
  redis.call('SET', rec, 'in-flight:' .. token .. ':' .. num(fence) .. ':' .. num(now + lease) .. ':' .. num(first), 'PX', ttl)
  return {'new', num(fence), num(first)}
end
local function release(rec, v, token, ttl)
  local f, d, fs = held(v, token)
  if not f then return 0 end
  redis.call('SET', rec, 'free:' .. f .. ':' .. fs, 'PX', ttl)
  return 1
end
local function extend(rec, v, token, now, lease, ttl)
  local f, d, fs = held(v, token)
  if not f then return 0 end
  redis.call('SET', rec, 'in-flight:' .. token .. ':' .. f .. ':' .. num(now + lease) .. ':' .. fs, 'PX', ttl)
  return 1
end
"#
    };
}
pub(super) use lua_record;

/// KEYS: rec. ARGV: token, lease ms, record TTL ms (retention + lease).
/// A `done` record answers `{'done', json}`, a live lease `{'busy'}`;
/// otherwise (no record, a free one, or a lease past its deadline: taken
/// over) the key gets this token's lease and the next fencing number, at
/// least the server's clock in ms and above the record's last one:
/// `{'new', fence, first seen}`. The record outlives the lease (its TTL is
/// the retention) so that the counter survives expiries and releases; a
/// record of the previous layout (`in-flight:<token>` with the lease as its
/// TTL) is busy until it expires.
const CLAIM: &str = concat!(
    lua_now!(),
    lua_record!(),
    "return claim(KEYS[1], redis.call('GET', KEYS[1]), ARGV[1], now, tonumber(ARGV[2]), ARGV[3])"
);

/// KEYS: rec. ARGV: token, lease ms, record TTL ms. Moves the deadline of
/// this token's lease (1), or answers 0 when the token no longer holds it.
/// A lease past its deadline that nobody took over is still this token's.
const EXTEND: &str = concat!(
    lua_now!(),
    lua_record!(),
    "return extend(KEYS[1], redis.call('GET', KEYS[1]), ARGV[1], now, tonumber(ARGV[2]), ARGV[3])"
);

/// KEYS: rec, att. ARGV: token, done value, retention ms. Compare-and-set
/// from this token's lease to the done record; clears the failed attempts.
/// Answers 0 (not held), 1 (done) or 2 (done, and the key had attempts).
const COMPLETE: &str = concat!(
    lua_record!(),
    r#"
if not holds(redis.call('GET', KEYS[1]), ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1 + redis.call('DEL', KEYS[2])
"#
);

/// [`COMPLETE`] and, when it succeeds, the admin indexes of the completed
/// key in the same script (one Redis only: the index keys are in other
/// slots than the key's records). KEYS: rec, att, the consumer's done
/// index, its failing set, the set of consumers; ARGV: token, done value,
/// retention ms, first-seen ms, key, retention horizon ms, consumer, and
/// `1` when the index's TTL and trimming and the set of consumers are due
/// (the store does them about once a second per consumer, not per key).
const COMPLETE_INDEXED: &str = concat!(
    lua_record!(),
    r#"
if not holds(redis.call('GET', KEYS[1]), ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if redis.call('DEL', KEYS[2]) == 1 then redis.call('SREM', KEYS[4], ARGV[5]) end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
if ARGV[8] == '1' then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[6])
  redis.call('SADD', KEYS[5], ARGV[7])
end
return 1
"#
);

/// KEYS: rec. ARGV: token, record TTL ms. Compare-and-release: this
/// token's lease becomes a free record keeping the fencing counter.
pub(super) const RELEASE: &str = concat!(
    lua_record!(),
    "return release(KEYS[1], redis.call('GET', KEYS[1]), ARGV[1], ARGV[2])"
);

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

/// KEYS: rec. ARGV: record TTL ms. Frees a lease whatever its token,
/// keeping the fencing counter.
const FORCE_RELEASE: &str = r#"
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 10) ~= 'in-flight:' then return 0 end
local f, d, fs = string.match(v, '^in%-flight:[^:]*:(%d+):([^:]+):(%d+)$')
if f then
  redis.call('SET', KEYS[1], 'free:' .. f .. ':' .. fs, 'PX', ARGV[1])
else
  redis.call('DEL', KEYS[1])
end
return 1
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
