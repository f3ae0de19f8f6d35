//! Sinks: what happens to a newly processed message. `--apply-sql` runs a
//! SQL template in the inbox transaction; `--print` writes a JSON line;
//! `--apply-http` ([`http`]) and `--apply-exec` ([`exec`]) call out through
//! the effect journal.

use std::borrow::Cow;
use std::future::Future;
use std::io::Write;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Result;
use idemq::engine::BatchResult;
use idemq::template::{Placeholder, RowsTemplate, SqlTemplate, SqlValue, ValueSpec};
use idemq::{Context, Handler, HandlerError, HandlerResult, InputError};
use serde_json::json;
use sqlx::database::HasStatementCache;
use sqlx::query::Query;
use sqlx::{Connection, Database, Encode, Executor, IntoArguments, Pool, Transaction, Type};

use crate::backend::Backend;
use crate::{exit, SinkArgs};

#[cfg(feature = "exec")]
mod exec;
#[cfg(feature = "http")]
mod http;
#[cfg(feature = "mongodb")]
mod mongo;

/// The future a [`Handler`] returns.
type HandlerFuture<'a> = Pin<Box<dyn Future<Output = HandlerResult> + Send + 'a>>;

/// A handler chosen at run time (SQL or print), boxed.
pub type BoxedHandler<Tx> = Box<dyn Handler<Tx>>;

/// Checks that every `--param` names a parameter of the template.
pub fn check_params(template: &SqlTemplate, params: &[(String, ValueSpec)]) -> Result<()> {
    let names = template.params();
    for (name, _) in params {
        if !names.contains(&name.as_str()) {
            let known = if names.is_empty() {
                "the statement has no parameters".to_owned()
            } else {
                format!("its parameters are :{}", names.join(", :"))
            };
            return Err(exit::usage(format!(
                "--param {name}=…: the --apply-sql statement has no parameter :{name} ({known})"
            )));
        }
    }
    Ok(())
}

/// A rendered `--apply-sql` statement and the source of each bound value.
#[derive(Debug)]
pub struct SqlStatement {
    sql: String,
    /// Whether one cached statement serves every type of value; if not,
    /// the types go into the statement's text (see [`SqlDialect::cache_statements`](crate::backend::SqlDialect)).
    cached: bool,
    /// One per placeholder, in binding order.
    values: Vec<ValueSpec>,
    /// The multi-row form, if the statement merges (batch mode writes a
    /// batch's rows in one statement).
    rows: Option<RowsTemplate>,
    placeholder: Placeholder,
}

/// At most this many values are bound to one merged statement (SQLite's
/// default limit is 32,766; PostgreSQL's and MySQL's 65,535).
const MAX_MERGED_BINDS: usize = 32_000;

/// At most this many rows go into one merged statement.
const MAX_MERGED_ROWS: usize = 1_000;

impl SqlStatement {
    /// Renders `template` for a database; `params` override where values come from.
    pub fn new(
        template: &SqlTemplate,
        params: &[(String, ValueSpec)],
        placeholder: Placeholder,
        cached: bool,
    ) -> Self {
        let (sql, order) = template.render(placeholder);
        let values = order
            .iter()
            .map(|name| {
                params
                    .iter()
                    .rev() // the last --param for a name wins
                    .find(|(n, _)| n == name)
                    .map(|(_, spec)| spec.clone())
                    .unwrap_or_else(|| ValueSpec::default_for(name))
            })
            .collect();
        Self {
            sql,
            cached,
            values,
            rows: template.rows(),
            placeholder,
        }
    }

    /// The text to prepare for `sql` bound to `values`: as it is where one
    /// cached statement takes any types, else with the values' types in a
    /// leading comment, so that each combination is its own cached
    /// statement (PostgreSQL fixes a statement's parameter types when it
    /// prepares it).
    fn typed<'s>(&self, sql: &'s str, values: &[SqlValue]) -> Cow<'s, str> {
        if self.cached {
            return Cow::Borrowed(sql);
        }
        let types: String = values
            .iter()
            .map(|v| match v {
                SqlValue::Null => 'n',
                SqlValue::Bool(_) => 'b',
                SqlValue::Int(_) => 'i',
                SqlValue::Float(_) => 'f',
                SqlValue::Text(_) => 't',
            })
            .collect();
        Cow::Owned(format!("/* idemq {types} */ {sql}"))
    }

    /// Whether batch mode writes a batch's rows with one statement.
    pub fn merges(&self) -> bool {
        self.rows.is_some()
    }

    /// How many rows one merged statement takes.
    fn rows_per_statement(&self) -> usize {
        (MAX_MERGED_BINDS / self.values.len().max(1)).clamp(1, MAX_MERGED_ROWS)
    }

    /// The SQL with the database's placeholders.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The values to bind for one message (the payload is parsed once).
    fn resolve(&self, ctx: &Context<'_>) -> Result<Vec<SqlValue>, InputError> {
        let json = ctx.message.json().ok();
        self.values
            .iter()
            .map(|spec| spec.resolve(ctx, json.as_ref()))
            .collect()
    }
}

/// The number of rows a statement changed, for the stored result.
pub trait RowsAffected {
    /// Rows inserted, updated or deleted.
    fn rows(&self) -> u64;
}

#[cfg(feature = "sqlite")]
impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "postgres")]
impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

#[cfg(feature = "mysql")]
impl RowsAffected for sqlx::mysql::MySqlQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

/// How a database binds SQL NULL (a JSON null, an absent message id).
pub trait BindNull: Database {
    /// Binds NULL as the next parameter.
    fn bind_null<'q>(
        query: Query<'q, Self, Self::Arguments<'q>>,
    ) -> Query<'q, Self, Self::Arguments<'q>>;
}

#[cfg(feature = "sqlite")]
impl BindNull for sqlx::Sqlite {
    fn bind_null<'q>(
        query: Query<'q, Self, Self::Arguments<'q>>,
    ) -> Query<'q, Self, Self::Arguments<'q>> {
        query.bind(None::<String>)
    }
}

#[cfg(feature = "mysql")]
impl BindNull for sqlx::MySql {
    fn bind_null<'q>(
        query: Query<'q, Self, Self::Arguments<'q>>,
    ) -> Query<'q, Self, Self::Arguments<'q>> {
        query.bind(None::<String>)
    }
}

#[cfg(feature = "postgres")]
impl BindNull for sqlx::Postgres {
    fn bind_null<'q>(
        query: Query<'q, Self, Self::Arguments<'q>>,
    ) -> Query<'q, Self, Self::Arguments<'q>> {
        query.bind(pg::UntypedNull)
    }
}

/// A PostgreSQL NULL whose type the server infers from the statement, so that
/// a JSON null fits an integer or numeric column as well as a text one (a
/// NULL typed as text would be rejected by a non-text column).
#[cfg(feature = "postgres")]
mod pg {
    use sqlx::encode::IsNull;
    use sqlx::error::BoxDynError;
    use sqlx::postgres::types::Oid;
    use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo};
    use sqlx::{Encode, Postgres, Type};

    /// NULL with the unspecified type (OID 0).
    pub struct UntypedNull;

    impl Type<Postgres> for UntypedNull {
        fn type_info() -> PgTypeInfo {
            PgTypeInfo::with_oid(Oid(0))
        }
    }

    impl Encode<'_, Postgres> for UntypedNull {
        fn encode_by_ref(&self, _buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
            Ok(IsNull::Yes)
        }
    }
}

/// Runs an [`SqlStatement`] per message in the transaction that claimed its key.
pub struct SqlHandler<DB> {
    statement: Arc<SqlStatement>,
    _db: PhantomData<fn() -> DB>,
}

impl<DB> SqlHandler<DB> {
    /// A handler running `statement`.
    pub fn new(statement: Arc<SqlStatement>) -> Self {
        Self {
            statement,
            _db: PhantomData,
        }
    }
}

impl<DB> Handler<Transaction<'static, DB>> for SqlHandler<DB>
where
    DB: Database + HasStatementCache + BindNull,
    DB::QueryResult: RowsAffected,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> bool: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> f64: Encode<'q, DB> + Type<DB>,
{
    fn handle<'a>(
        &'a self,
        ctx: &'a Context<'a>,
        tx: &'a mut Transaction<'static, DB>,
    ) -> HandlerFuture<'a> {
        Box::pin(async move {
            // A value the statement needs is absent or unusable: retrying cannot help.
            let values = self
                .statement
                .resolve(ctx)
                .map_err(HandlerError::permanent)?;
            let sql = self.statement.typed(self.statement.sql(), &values);
            let done = bind_all(sqlx::query::<DB>(&sql), values)
                .execute(&mut **tx)
                .await?;
            Ok(Some(json!({ "rows_affected": done.rows() })))
        })
    }

    fn handles_batches(&self) -> bool {
        self.statement.merges()
    }

    /// The batch's rows in merged statements (see [`RowsTemplate`]). Each
    /// message's stored result is its own `rows_affected`, as in per-message
    /// mode: known when the merged statements changed no row or one per
    /// message. Otherwise (some rows hit a conflict) the count cannot be
    /// split, and the batch runs again one message at a time.
    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Transaction<'static, DB>,
    ) -> Pin<Box<dyn Future<Output = BatchResult> + Send + 'a>> {
        Box::pin(async move {
            let statement = &*self.statement;
            let Some(rows) = &statement.rows else {
                return Err(HandlerError::permanent("the statement does not merge"));
            };
            let values = batch
                .iter()
                .map(|ctx| statement.resolve(ctx))
                .collect::<Result<Vec<_>, _>>()
                .map_err(HandlerError::permanent)?;
            let mut changed = 0;
            for chunk in values.chunks(statement.rows_per_statement()) {
                let merged = rows.render(statement.placeholder, chunk.len());
                let chunk: Vec<SqlValue> = chunk.iter().flatten().cloned().collect();
                let sql = statement.typed(&merged, &chunk);
                let done = bind_all(sqlx::query::<DB>(&sql), chunk)
                    .execute(&mut **tx)
                    .await?;
                changed += done.rows();
            }
            let each = match changed {
                0 => 0,
                n if n == batch.len() as u64 => 1,
                n => {
                    return Err(HandlerError::retryable(format!(
                        "the merged statement changed {n} rows for {} messages, which does not \
                         tell each message's count",
                        batch.len()
                    )))
                }
            };
            Ok(vec![Some(json!({ "rows_affected": each })); batch.len()])
        })
    }
}

/// Binds `values` to `query` in order.
fn bind_all<'q, DB>(
    mut query: Query<'q, DB, DB::Arguments<'q>>,
    values: impl IntoIterator<Item = SqlValue>,
) -> Query<'q, DB, DB::Arguments<'q>>
where
    DB: Database + BindNull,
    for<'v> String: Encode<'v, DB> + Type<DB>,
    for<'v> bool: Encode<'v, DB> + Type<DB>,
    for<'v> i64: Encode<'v, DB> + Type<DB>,
    for<'v> f64: Encode<'v, DB> + Type<DB>,
{
    for value in values {
        query = match value {
            SqlValue::Null => DB::bind_null(query),
            SqlValue::Bool(b) => query.bind(b),
            SqlValue::Int(i) => query.bind(i),
            SqlValue::Float(f) => query.bind(f),
            SqlValue::Text(s) => query.bind(s),
        };
    }
    query
}

/// Prints each processed message to stdout as `{"key":…,"payload":…}`.
pub struct PrintHandler;

impl<Tx: Send + 'static> Handler<Tx> for PrintHandler {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, _tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            let payload = ctx.message.json().unwrap_or_else(|_| {
                serde_json::Value::String(String::from_utf8_lossy(&ctx.message.payload).into())
            });
            let line = json!({ "key": ctx.key, "payload": payload });
            let mut out = std::io::stdout().lock();
            writeln!(out, "{line}")
                .and_then(|()| out.flush())
                .map_err(|e| HandlerError::retryable(format!("writing to stdout: {e}")))?;
            Ok(None)
        })
    }
}

/// Runs one statement on the pool, outside any transaction.
pub async fn execute_raw<DB>(pool: &Pool<DB>, sql: &str) -> Result<(), sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    sqlx::raw_sql(sql).execute(pool).await.map(|_| ())
}

/// Prepares a statement (checks syntax and tables) without running it, on a
/// connection of its own that is closed afterwards: sqlx would otherwise keep
/// the statement cached with the parameter types the database inferred, and
/// PostgreSQL would reject the differently typed values bound later.
pub async fn prepare<DB>(pool: &Pool<DB>, sql: &str) -> Result<(), sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    let mut conn = pool.acquire().await?.detach();
    let prepared = (&mut conn).prepare(sql).await.map(|_| ());
    if let Err(e) = conn.close().await {
        tracing::debug!(error = %e, "closing the connection used to prepare --apply-sql");
    }
    prepared
}

/// The sink the flags ask for: its handler, and the statement to validate.
pub struct Sink<Tx> {
    /// The handler for the consumer.
    pub handler: BoxedHandler<Tx>,
    /// The `--apply-sql` statement, if that is the sink.
    pub statement: Option<Arc<SqlStatement>>,
}

/// Builds the sink the flags ask for (no database access yet).
pub async fn build<B: Backend>(args: &SinkArgs) -> Result<Sink<B::Tx>> {
    match &args.target.apply_sql {
        Some(template) => {
            check_params(template, &args.params)?;
            let Some(dialect) = B::SQL else {
                return Err(not_sql("--apply-sql"));
            };
            let statement = Arc::new(SqlStatement::new(
                template,
                &args.params,
                dialect.placeholder,
                dialect.cache_statements,
            ));
            let handler =
                B::sql_handler(Arc::clone(&statement)).ok_or_else(|| not_sql("--apply-sql"))?;
            Ok(Sink {
                handler,
                statement: Some(statement),
            })
        }
        None => Ok(Sink {
            handler: call_out_or_print(args).await?,
            statement: None,
        }),
    }
}

/// `--http-timeout` and `--exec-timeout` when not given.
#[cfg(any(feature = "http", feature = "exec"))]
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The handler of a sink without SQL: `--apply-http`, `--apply-exec`,
/// `--apply-mongo` or `--print`.
async fn call_out_or_print<Tx: Send + 'static>(args: &SinkArgs) -> Result<BoxedHandler<Tx>> {
    if let Some(url) = &args.target.apply_mongo {
        #[cfg(feature = "mongodb")]
        return Ok(Box::new(mongo::handler(url).await?));
        #[cfg(not(feature = "mongodb"))]
        return Err(exit::usage(format!(
            "--apply-mongo {}: {}",
            crate::backend::redact(url),
            crate::backend::compiled_out("MongoDB", "mongodb")
        )));
    }
    if let Some(url) = &args.target.apply_http {
        #[cfg(feature = "http")]
        return Ok(Box::new(http::HttpSink::new(
            url,
            args.http_timeout.unwrap_or(CALL_TIMEOUT),
            &args.http_headers,
        )?));
        #[cfg(not(feature = "http"))]
        return Err(exit::usage(format!(
            "--apply-http {}: {}",
            crate::backend::redact(url),
            crate::backend::compiled_out("HTTP", "http")
        )));
    }
    if let Some(command) = &args.target.apply_exec {
        #[cfg(feature = "exec")]
        return Ok(Box::new(exec::ExecSink::new(
            command,
            args.exec_timeout.unwrap_or(CALL_TIMEOUT),
        )));
        #[cfg(not(feature = "exec"))]
        return Err(exit::usage(format!(
            "--apply-exec {command:?}: {}",
            crate::backend::compiled_out("--apply-exec", "exec")
        )));
    }
    Ok(Box::new(PrintHandler))
}

/// Runs the `--init-sql` statements, then prepares the `--apply-sql` statement
/// so that a typo or a missing table fails before any message is read.
pub async fn init<B: Backend>(
    store: &B,
    args: &SinkArgs,
    statement: Option<&SqlStatement>,
) -> Result<()> {
    let sql = store.as_sql();
    let Some(sql) = sql else {
        if !args.init_sql.is_empty() {
            return Err(not_sql("--init-sql"));
        }
        return Ok(());
    };
    for init in &args.init_sql {
        sql.execute_raw(init)
            .await
            .map_err(|e| classify(e, &format!("--init-sql {init:?} failed")))?;
    }
    if let Some(statement) = statement {
        sql.prepare(statement.sql()).await.map_err(|e| {
            classify(
                e,
                &format!(
                    "the --apply-sql statement {:?} does not prepare",
                    statement.sql()
                ),
            )
        })?;
    }
    Ok(())
}

/// The usage error for a SQL-only flag on a store that is not a SQL database.
fn not_sql(flag: &str) -> anyhow::Error {
    exit::usage(format!(
        "{flag} needs a SQL store (sqlite:, postgres://, mysql://): a redis:// or mongodb:// \
         store holds leases, not your tables; use --print, --apply-mongo, --apply-http or \
         --apply-exec, or keep the inbox in SQL (and put Redis in front with --cache)"
    ))
}

/// A database error at setup: transient ones are runtime errors, the rest
/// (syntax, missing table, permissions) are configuration errors.
fn classify(err: sqlx::Error, what: &str) -> anyhow::Error {
    if idemq::store::sql::is_transient(&err) {
        anyhow::Error::new(err).context(what.to_owned())
    } else {
        exit::usage(format!("{what}: {err}"))
    }
}
