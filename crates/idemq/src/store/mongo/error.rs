//! The Mongo store's errors and how they map to [`StoreError`] kinds.

use mongodb::error::{ErrorKind, WriteFailure};

use crate::error::{StoreError, StoreErrorKind};

/// Duplicate key: another writer inserted the same `_id` (or unique field) first.
const DUPLICATE_KEY: i32 = 11000;

/// Server error codes after which a retry may succeed: a node stepping
/// down, shutting down or recovering, network and time limits, write
/// conflicts; and FerretDB's `InternalError` (1), which it answers when its
/// PostgreSQL is unreachable.
const TRANSIENT_CODES: &[i32] = &[
    1, 6, 7, 50, 89, 91, 112, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436,
];

/// What went wrong in the Mongo store; converted into a [`StoreError`]
/// (its [`kind`](StoreError::kind) says whether a retry may help).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MongoError {
    /// The driver or the server failed (shown by its kind: the driver's
    /// own text adds the whole server response).
    #[error("mongodb: {}", .0.kind)]
    Driver(#[from] mongodb::error::Error),
    /// A stored document could not be read back.
    #[error("unreadable {what} document: {detail}")]
    Corrupt {
        /// Which kind of document.
        what: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// The URL or an option is invalid.
    #[error("{0}")]
    Config(String),
    /// Writers kept racing for the same key: the operation gave up for now.
    #[error("{0}")]
    Contended(String),
}

impl MongoError {
    /// The store error kind this error maps to.
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            MongoError::Driver(e) if is_transient(e) => StoreErrorKind::Transient,
            MongoError::Driver(_) => StoreErrorKind::Other,
            MongoError::Corrupt { .. } => StoreErrorKind::Corrupt,
            MongoError::Config(_) => StoreErrorKind::Config,
            MongoError::Contended(_) => StoreErrorKind::Transient,
        }
    }
}

impl From<MongoError> for StoreError {
    fn from(e: MongoError) -> Self {
        let kind = e.kind();
        StoreError::new(kind, e.to_string()).with_source(e)
    }
}

/// Maps a driver error to a store error.
pub(super) fn map_err(e: mongodb::error::Error) -> StoreError {
    MongoError::Driver(e).into()
}

/// The server error code of `e`, if it carries one.
pub(super) fn code(e: &mongodb::error::Error) -> Option<i32> {
    match e.kind.as_ref() {
        ErrorKind::Command(c) => Some(c.code),
        ErrorKind::Write(WriteFailure::WriteError(w)) => Some(w.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => Some(w.code),
        ErrorKind::InsertMany(m) => m
            .write_errors
            .as_ref()
            .and_then(|errors| errors.first())
            .map(|w| w.code)
            .or_else(|| m.write_concern_error.as_ref().map(|w| w.code)),
        _ => None,
    }
}

/// Whether `e` is a duplicate-key error of a single write.
pub(crate) fn is_duplicate(e: &mongodb::error::Error) -> bool {
    code(e) == Some(DUPLICATE_KEY)
}

/// For an unordered `insert_many` that failed: the indexes of the documents
/// refused as duplicates, or `None` if anything else went wrong (then the
/// whole error stands).
pub(super) fn duplicate_indexes(e: &mongodb::error::Error) -> Option<Vec<usize>> {
    let ErrorKind::InsertMany(m) = e.kind.as_ref() else {
        return None;
    };
    if m.write_concern_error.is_some() {
        return None;
    }
    let errors = m.write_errors.as_ref()?;
    errors
        .iter()
        .map(|w| (w.code == DUPLICATE_KEY).then_some(w.index))
        .collect()
}

pub(crate) fn is_transient(e: &mongodb::error::Error) -> bool {
    matches!(
        e.kind.as_ref(),
        ErrorKind::Io(_)
            | ErrorKind::ConnectionPoolCleared { .. }
            | ErrorKind::ServerSelection { .. }
    ) || e.contains_label("RetryableWriteError")
        || e.contains_label("TransientTransactionError")
        || e.contains_label("SystemOverloadedError")
        || code(e).is_some_and(|c| TRANSIENT_CODES.contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_cause() {
        let io: mongodb::error::Error =
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert_eq!(MongoError::from(io).kind(), StoreErrorKind::Transient);
        let corrupt = MongoError::Corrupt {
            what: "slot",
            detail: "no kind".into(),
        };
        let store: StoreError = corrupt.into();
        assert_eq!(store.kind(), StoreErrorKind::Corrupt);
        assert!(std::error::Error::source(&store).is_some());
        assert_eq!(
            StoreError::from(MongoError::Config("bad".into())).kind(),
            StoreErrorKind::Config
        );
    }
}
