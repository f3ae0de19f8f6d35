//! The messages of a chaos cell: orders with an amount, duplicates of both
//! kinds, and poison; and their publication.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use idemq::source::Publisher;
use idemq::Message;

use crate::endpoint::Endpoint;

/// Why a poison message must end in the dead-letter table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poison {
    /// The payload is not JSON: reason `malformed_json`.
    Undecodable,
    /// JSON without `order_id`: reason `missing_key`.
    MissingKey,
}

impl Poison {
    /// The dead-letter reason code the consumer must write.
    pub fn reason(self) -> &'static str {
        match self {
            Poison::Undecodable => "malformed_json",
            Poison::MissingKey => "missing_key",
        }
    }
}

/// What a cell publishes, and what the ledger must hold afterwards.
#[derive(Debug, Default)]
pub struct Plan {
    /// The messages in publication order.
    pub messages: Vec<Message>,
    /// Every business key and its amount: each must be applied exactly once.
    pub orders: BTreeMap<String, i64>,
    /// Poison messages: a token found in the payload, and the expected reason.
    pub poison: Vec<(String, Poison)>,
    /// Extra copies with the same message id (broker or producer redelivery).
    pub same_id: u64,
    /// Extra copies with a new message id and the same key (producer retry).
    pub new_id: u64,
}

impl Plan {
    /// `orders` orders `ord-RUN-N` with amounts 1..=1000; a fraction
    /// `same_id` of them sent again with the same id, a fraction `new_id`
    /// sent again with a new id; `poison` poison messages (alternately
    /// undecodable and without a key). Copies land at random later positions.
    pub fn generate(
        run: &str,
        orders: usize,
        same_id: f64,
        new_id: f64,
        poison: usize,
        rng: &mut fastrand::Rng,
    ) -> Self {
        let mut plan = Plan::default();
        let mut copies = Vec::new();
        for n in 0..orders {
            let key = format!("ord-{run}-{n}");
            let amount = rng.i64(1..=1000);
            let payload = serde_json::json!({ "order_id": key, "amount": amount }).to_string();
            let message = Message::new(payload)
                .with_id(format!("msg-{run}-{n}"))
                .with_key(key.clone());
            plan.orders.insert(key, amount);
            if rng.f64() < same_id {
                copies.push((n, message.clone()));
                plan.same_id += 1;
            }
            if rng.f64() < new_id {
                copies.push((n, message.clone().with_id(format!("msg-{run}-{n}-retry"))));
                plan.new_id += 1;
            }
            plan.messages.push(message);
        }
        // Each copy a little after its original (within 200 messages); from
        // the last original back, so that earlier indices stay valid.
        for (n, copy) in copies.into_iter().rev() {
            let end = plan.messages.len().min(n + 201);
            let at = rng.usize(n + 1..=end);
            plan.messages.insert(at, copy);
        }
        for n in 0..poison {
            let token = format!("poison-{run}-{n}");
            let (payload, kind) = if n % 2 == 0 {
                (format!("{{this is not json {token}"), Poison::Undecodable)
            } else {
                (
                    serde_json::json!({ "amount": 1, "note": token }).to_string(),
                    Poison::MissingKey,
                )
            };
            let message = Message::new(payload).with_id(token.clone());
            let at = rng.usize(0..=plan.messages.len());
            plan.messages.insert(at, message);
            plan.poison.push((token, kind));
        }
        plan
    }

    /// The sum the ledger must show.
    pub fn total(&self) -> i64 {
        self.orders.values().sum()
    }

    /// Publishes every message to `to` (the same publishers as `idemq
    /// produce`); to a broker over 8 concurrent lanes (message `n` in lane
    /// `n % 8`, so the order stays roughly that of the plan).
    pub async fn publish(&self, to: &Endpoint) -> Result<()> {
        let publisher: Arc<dyn Publisher> = Arc::from(to.open_publisher().await?);
        let lanes = if matches!(to, Endpoint::File(_)) {
            1
        } else {
            8
        };
        let mut tasks = tokio::task::JoinSet::new();
        for lane in 0..lanes {
            let publisher = Arc::clone(&publisher);
            let messages: Vec<Message> = self
                .messages
                .iter()
                .skip(lane)
                .step_by(lanes)
                .cloned()
                .collect();
            let to = to.to_string();
            tasks.spawn(async move {
                for message in &messages {
                    publisher
                        .publish(message)
                        .await
                        .with_context(|| format!("publishing to {to}"))?;
                }
                anyhow::Ok(())
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.context("a publishing task failed")??;
        }
        publisher.flush().await.context("flushing the publisher")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_have_every_kind_of_message() {
        let mut rng = fastrand::Rng::with_seed(7);
        let plan = Plan::generate("r", 300, 0.2, 0.1, 6, &mut rng);
        assert_eq!(plan.orders.len(), 300);
        assert_eq!(plan.poison.len(), 6);
        assert!(plan.same_id > 20 && plan.new_id > 10, "{plan:?}");
        assert_eq!(
            plan.messages.len() as u64,
            300 + 6 + plan.same_id + plan.new_id
        );
        // Every copy carries the key and payload of its original.
        for m in &plan.messages {
            if let Some(key) = &m.key {
                let json: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
                assert_eq!(json["order_id"].as_str(), Some(key.as_str()));
                assert_eq!(json["amount"].as_i64(), Some(plan.orders[key]));
            }
        }
    }
}
