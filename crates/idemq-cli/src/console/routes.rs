//! The console's routes: pages read the store on each request; the two
//! POST routes (replay, delete) check the form token and `--allow-changes`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::sync::lock;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use maud::Markup;
use serde::Deserialize;
use tokio::sync::oneshot;

use super::views::{self, Actions, Chrome, ConsumerRow, Group, ScrapeStatus};
use super::{Console, ReplayJob, Settled};
use crate::backend::Backend;
use crate::commands::dlq::collect;
use crate::commands::inspect::{story, KeyStory};

/// Letters shown per page of `/letters`.
const PAGE: u32 = 100;
/// Letters read per query while scanning (one page held at a time).
const SCAN_PAGE: u32 = 100;
/// Letters read at most to group one consumer's by reason.
const GROUP_SCAN: usize = 50_000;

type Shared<B> = State<Arc<Console<B>>>;

/// Every route of the console.
pub(super) fn router<B: Backend + Clone>(console: Arc<Console<B>>) -> Router {
    Router::new()
        .route("/", get(overview::<B>))
        .route("/consumer", get(consumer::<B>))
        .route("/letters", get(letters::<B>))
        .route("/letter", get(letter::<B>))
        .route("/lookup", get(lookup::<B>))
        .route("/outbox", get(outbox::<B>))
        .route("/replay", post(replay::<B>))
        .route("/delete", post(delete::<B>))
        .with_state(console)
}

impl<B> Console<B> {
    fn page(&self, title: &str, body: Markup) -> Response {
        let chrome = Chrome {
            allow_changes: self.allow_changes,
            notes: &self.notes,
        };
        (
            [(header::CACHE_CONTROL, "no-store")],
            views::page(title, &chrome, body),
        )
            .into_response()
    }

    fn problem(&self, status: StatusCode, text: &str) -> Response {
        let mut response = self.page("error", views::problem(text));
        *response.status_mut() = status;
        response
    }

    fn actions(&self, consumer: &str) -> Actions<'_> {
        Actions {
            allow_changes: self.allow_changes,
            can_replay: self.replayable.iter().any(|c| c == consumer),
            token: &self.token,
        }
    }

    fn every(&self) -> String {
        humantime::format_duration(self.sample_every).to_string()
    }
}

/// A store error as a page (its text names no secret: the store's errors
/// are redacted where they are made).
fn store_failed<B>(console: &Console<B>, doing: &str, e: impl std::fmt::Display) -> Response {
    console.problem(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("{doing} failed: {e}"),
    )
}

async fn overview<B: Backend + Clone>(State(console): Shared<B>) -> Response {
    let stats = match console.store.stats().await {
        Ok(stats) => stats,
        Err(e) => return store_failed(&console, "reading the consumers", e),
    };
    let rows: Vec<ConsumerRow> = stats
        .into_iter()
        .map(|stats| ConsumerRow {
            steps: console.history.steps(&stats.consumer),
            stats,
        })
        .collect();
    let scrape = ScrapeStatus {
        targets: console.scrape_targets.clone(),
        failing: lock(&console.scrape_failing).clone(),
    };
    console.page(
        "Consumers",
        views::overview(&rows, console.history.len(), &console.every(), &scrape),
    )
}

#[derive(Deserialize)]
struct ConsumerQuery {
    name: String,
}

async fn consumer<B: Backend + Clone>(
    State(console): Shared<B>,
    Query(q): Query<ConsumerQuery>,
) -> Response {
    let (groups, scanned_all) = match group_by_reason(console.store.as_ref(), &q.name).await {
        Ok(scan) => scan,
        Err(e) => return store_failed(&console, "reading dead letters", e),
    };
    let steps = console.history.steps(&q.name);
    let body = views::consumer(
        &q.name,
        &steps,
        &groups,
        scanned_all,
        &console.actions(&q.name),
    );
    console.page(&q.name, body)
}

/// The consumer's dead letters summed up by reason, most letters first,
/// read a page at a time (only one page is held: letters can be large),
/// at most [`GROUP_SCAN`] letters; and whether that was all of them.
async fn group_by_reason<B: Backend>(
    store: &B,
    consumer: &str,
) -> Result<(Vec<Group>, bool), idemq::StoreError> {
    let mut groups: BTreeMap<String, Group> = BTreeMap::new();
    let mut after = 0;
    let mut read = 0;
    let scanned_all = loop {
        if read >= GROUP_SCAN {
            break false;
        }
        let page = store.dead_letters(Some(consumer), after, SCAN_PAGE).await?;
        let full = page.len() == SCAN_PAGE as usize;
        let Some(last) = page.last() else {
            break true;
        };
        after = last.id;
        read += page.len();
        for d in page {
            let group = groups.entry(d.reason.clone()).or_insert_with(|| Group {
                reason: d.reason.clone(),
                count: 0,
                oldest_ms: d.created_ms,
                newest_ms: d.created_ms,
                last_error: String::new(),
            });
            group.count += 1;
            group.oldest_ms = group.oldest_ms.min(d.created_ms);
            if d.created_ms >= group.newest_ms {
                group.newest_ms = d.created_ms;
                group.last_error = d.error;
            }
        }
        if !full {
            break true;
        }
    };
    let mut groups: Vec<Group> = groups.into_values().collect();
    groups.sort_by(|a, b| b.count.cmp(&a.count).then(a.reason.cmp(&b.reason)));
    Ok((groups, scanned_all))
}

#[derive(Deserialize)]
struct LettersQuery {
    consumer: String,
    reason: String,
    #[serde(default)]
    after: i64,
}

async fn letters<B: Backend + Clone>(
    State(console): Shared<B>,
    Query(q): Query<LettersQuery>,
) -> Response {
    // Letters of one reason, a page at a time: read pages of all reasons
    // until this one has a page's worth.
    let mut shown = Vec::new();
    let mut after = q.after;
    let mut more = false;
    loop {
        let page = match console
            .store
            .dead_letters(Some(&q.consumer), after, SCAN_PAGE)
            .await
        {
            Ok(page) => page,
            Err(e) => return store_failed(&console, "reading dead letters", e),
        };
        let full = page.len() == SCAN_PAGE as usize;
        let Some(last) = page.last() else { break };
        after = last.id;
        for d in page {
            if d.reason != q.reason {
                continue;
            }
            if shown.len() == PAGE as usize {
                more = true;
                break;
            }
            shown.push(d);
        }
        if more || !full {
            break;
        }
    }
    let next = more.then(|| shown.last().map(|d| d.id)).flatten();
    let body = views::letters(
        &q.consumer,
        &q.reason,
        &shown,
        next,
        &console.actions(&q.consumer),
    );
    console.page(&format!("{} · {}", q.consumer, q.reason), body)
}

#[derive(Deserialize)]
struct LetterQuery {
    consumer: String,
    id: i64,
}

async fn letter<B: Backend + Clone>(
    State(console): Shared<B>,
    Query(q): Query<LetterQuery>,
) -> Response {
    let found = match console
        .store
        .dead_letters(Some(&q.consumer), q.id.saturating_sub(1), 1)
        .await
    {
        Ok(page) => page.into_iter().find(|d| d.id == q.id),
        Err(e) => return store_failed(&console, "reading the dead letter", e),
    };
    match found {
        Some(d) => console.page(
            &format!("dead letter #{}", d.id),
            views::letter(&d, &console.actions(&q.consumer)),
        ),
        None => console.problem(
            StatusCode::NOT_FOUND,
            &format!(
                "Dead letter #{} of consumer {:?} is not in the store (replayed or deleted?).",
                q.id, q.consumer
            ),
        ),
    }
}

#[derive(Deserialize)]
struct LookupQuery {
    #[serde(default)]
    consumer: String,
    #[serde(default)]
    key: String,
}

async fn lookup<B: Backend + Clone>(
    State(console): Shared<B>,
    Query(q): Query<LookupQuery>,
) -> Response {
    let consumers: Vec<String> = match console.store.stats().await {
        Ok(stats) => stats.into_iter().map(|s| s.consumer).collect(),
        Err(e) => return store_failed(&console, "reading the consumers", e),
    };
    if q.key.is_empty() {
        return console.page(
            "Look up a key",
            views::lookup(&consumers, &q.consumer, "", None),
        );
    }
    let KeyStory {
        report,
        effects,
        found,
    } = match story(console.store.as_ref(), &q.consumer, &q.key).await {
        Ok(story) => story,
        Err((e, doing)) => return store_failed(&console, doing, e),
    };
    let body = views::lookup(
        &consumers,
        &q.consumer,
        &q.key,
        found.then_some((&report, effects.as_slice())),
    );
    let mut response = console.page(&format!("key {}", q.key), body);
    if !found {
        *response.status_mut() = StatusCode::NOT_FOUND;
    }
    response
}

async fn outbox<B: Backend + Clone>(State(console): Shared<B>) -> Response {
    let Some(sql) = console.store.as_sql() else {
        return console.page("Outbox", views::outbox(None, false));
    };
    match sql.outbox(&console.table_prefix, 100).await {
        Ok(view) => console.page("Outbox", views::outbox(view.as_ref(), true)),
        Err(e) => store_failed(&console, "reading the outbox", e),
    }
}

/// A replay or delete form: the consumer, the token, and ids or a reason.
struct ActionForm {
    consumer: String,
    ids: BTreeSet<i64>,
    reason: Option<String>,
}

/// Why a form is refused: the status and the text of the page.
type Refusal = (StatusCode, &'static str);

/// Parses and checks a form.
fn action_form<B>(console: &Console<B>, body: &[u8]) -> Result<ActionForm, Refusal> {
    if !console.allow_changes {
        return Err((
            StatusCode::FORBIDDEN,
            "This console is read-only: start it with --allow-changes to replay or delete.",
        ));
    }
    let mut token = None;
    let mut consumer = None;
    let mut reason = None;
    let mut ids = BTreeSet::new();
    for (name, value) in form_urlencoded::parse(body) {
        match name.as_ref() {
            "token" => token = Some(value.into_owned()),
            "consumer" => consumer = Some(value.into_owned()),
            "reason" => reason = Some(value.into_owned()),
            "id" => match value.parse() {
                Ok(id) => {
                    ids.insert(id);
                }
                Err(_) => {
                    return Err((StatusCode::BAD_REQUEST, "A dead-letter id is not a number."))
                }
            },
            _ => {}
        }
    }
    if token.as_deref() != Some(console.token.as_str()) {
        return Err((
            StatusCode::FORBIDDEN,
            "The form is stale or did not come from this console: reload the page and try again.",
        ));
    }
    let Some(consumer) = consumer else {
        return Err((StatusCode::BAD_REQUEST, "The form names no consumer."));
    };
    if ids.is_empty() && reason.is_none() {
        return Err((
            StatusCode::BAD_REQUEST,
            "Nothing selected: tick the dead letters to act on.",
        ));
    }
    Ok(ActionForm {
        consumer,
        ids,
        reason,
    })
}

async fn replay<B: Backend + Clone>(State(console): Shared<B>, body: Bytes) -> Response {
    let form = match action_form(&console, &body) {
        Ok(form) => form,
        Err((status, text)) => return console.problem(status, text),
    };
    let (done, answer) = oneshot::channel();
    let job = ReplayJob {
        consumer: form.consumer.clone(),
        ids: form.ids.into_iter().collect(),
        reason: form.reason,
        done,
    };
    if console.replays.send(job).await.is_err() {
        return console.problem(StatusCode::SERVICE_UNAVAILABLE, "The console is stopping.");
    }
    match answer.await {
        Ok(Ok(lines)) => {
            tracing::info!(consumer = %form.consumer, letters = lines.len(), "dead letters replayed from the console");
            console.page(
                "Replayed",
                views::results(&form.consumer, "Replayed", &lines),
            )
        }
        Ok(Err(e)) => console.problem(StatusCode::CONFLICT, &e),
        Err(_) => console.problem(StatusCode::SERVICE_UNAVAILABLE, "The console is stopping."),
    }
}

async fn delete<B: Backend + Clone>(State(console): Shared<B>, body: Bytes) -> Response {
    let form = match action_form(&console, &body) {
        Ok(form) => form,
        Err((status, text)) => return console.problem(status, text),
    };
    let wanted = (!form.ids.is_empty()).then_some(&form.ids);
    let letters = match collect(console.store.as_ref(), &form.consumer, wanted).await {
        Ok(letters) => letters,
        Err(e) => return store_failed(&console, "reading dead letters", format!("{e:#}")),
    };
    let mut lines = Vec::new();
    for d in letters
        .iter()
        .filter(|d| form.reason.as_ref().is_none_or(|r| *r == d.reason))
    {
        match console.store.delete_dead_letter(d.id).await {
            Ok(true) => lines.push(Settled::new(d.id, "deleted", true)),
            Ok(false) => lines.push(Settled::new(d.id, "already gone", false)),
            Err(e) => lines.push(Settled::new(d.id, format!("not deleted: {e}"), false)),
        }
    }
    tracing::info!(consumer = %form.consumer, letters = lines.len(), "dead letters deleted from the console");
    console.page("Deleted", views::results(&form.consumer, "Deleted", &lines))
}
