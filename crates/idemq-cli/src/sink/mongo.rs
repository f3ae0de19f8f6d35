//! `--apply-mongo URL`: insert each newly claimed message into a MongoDB
//! collection once, keyed by the message key (`idemq::effect::mongo`).
//!
//! The URL is a MongoDB connection string whose path names the database and
//! the collection, `mongodb://HOST:PORT/DATABASE.COLLECTION[?options]` (as
//! the Spark and Kafka connectors spell it); the driver gets the URL with
//! `/DATABASE` only.

use anyhow::Result;
use idemq::effect::mongo::mongodb::bson::Document;
use idemq::effect::mongo::mongodb::Client;
use idemq::effect::mongo::UpsertHandler;

use crate::backend::redact;
use crate::exit;

/// Where `--apply-mongo` writes: the driver's URL, the database, the collection.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    url: String,
    database: String,
    collection: String,
}

/// Splits `mongodb://…/DATABASE.COLLECTION?…`.
fn parse(url: &str) -> Result<Target> {
    let shown = redact(url);
    let usage = |why: &str| {
        exit::usage(format!(
            "--apply-mongo {shown}: {why} (expected mongodb://HOST:PORT/DATABASE.COLLECTION)"
        ))
    };
    let rest = url
        .strip_prefix("mongodb://")
        .ok_or_else(|| usage("the scheme must be mongodb://"))?;
    let (authority, path_and_query) = rest
        .split_once('/')
        .ok_or_else(|| usage("no DATABASE.COLLECTION"))?;
    let (path, query) = match path_and_query.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path_and_query, None),
    };
    let (database, collection) = path
        .split_once('.')
        .ok_or_else(|| usage("no '.' between the database and the collection"))?;
    if authority.is_empty() || database.is_empty() || collection.is_empty() {
        return Err(usage("a part is empty"));
    }
    if collection.starts_with("system.") || collection.contains('$') {
        return Err(usage("not a collection a message may be written to"));
    }
    let url = match query {
        Some(query) => format!("mongodb://{authority}/{database}?{query}"),
        None => format!("mongodb://{authority}/{database}"),
    };
    Ok(Target {
        url,
        database: database.to_owned(),
        collection: collection.to_owned(),
    })
}

/// The `--apply-mongo` handler: parses the URL (the driver connects on first use).
pub async fn handler(url: &str) -> Result<UpsertHandler> {
    let target = parse(url)?;
    let client = Client::with_uri_str(&target.url)
        .await
        .map_err(|e| exit::usage(format!("--apply-mongo {}: {}", redact(url), e.kind)))?;
    let collection = client
        .database(&target.database)
        .collection::<Document>(&target.collection);
    Ok(UpsertHandler::new(collection))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_database_and_collection() {
        assert_eq!(
            parse("mongodb://u:p@h:27017/shop.payments?w=majority").unwrap(),
            Target {
                url: "mongodb://u:p@h:27017/shop?w=majority".into(),
                database: "shop".into(),
                collection: "payments".into(),
            }
        );
        assert_eq!(parse("mongodb://h/a.b.c").unwrap().collection, "b.c");
        for bad in [
            "mongodb://h:27017",
            "mongodb://h/shop",
            "mongodb://h/.x",
            "mongodb://h/shop.",
            "mongodb://h/shop.system.users",
            "postgres://h/shop.payments",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let err = parse("mongodb://u:secret@h/shop").unwrap_err().to_string();
        assert!(!err.contains("secret"), "{err}");
    }
}
