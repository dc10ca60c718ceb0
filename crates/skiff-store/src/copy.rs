//! Copying a SQLite state into an empty PostgreSQL database (`skiff admin migrate --to`),
//! all or nothing, verified before it commits.
//!
//! The SQLite side is read in one read transaction (a consistent snapshot, whatever else reads
//! the file). The PostgreSQL side is brought to this Skiff's schema (`PgStore`'s migrations),
//! then everything happens in ONE transaction: the target's tables are locked against other
//! writers, a target holding any row (but the first admin its schema seeds) is refused naming
//! the table, every table is streamed across (`COPY … FROM STDIN` in binary), the database's
//! own counters are set so new writes continue after the copied rows, and each table is read
//! back and compared. Any failure — a value PostgreSQL refuses, a mismatch — drops the
//! transaction, so the target is left exactly as empty as it was.
//!
//! **Which tables.** The SQLite schema decides: every table it has must exist in PostgreSQL
//! with every one of its columns (else the copy refuses, naming what is missing: data is never
//! dropped silently). PostgreSQL's own extra columns must fill themselves (a default, NULL or
//! an identity such as `sessions.ord`); its bookkeeping tables are filled here
//! (`event_cursors`, `audit_next`, identity sequences). Tables go in foreign-key order
//! (PostgreSQL's constraints), ties in SQLite's creation order; rows in rowid order, which is
//! creation order, so an identity column like `sessions.ord` numbers them as SQLite did, and a
//! row that refers to another of its table (a child session, an entry's parent) comes after it.
//!
//! **The checksum** of a table is the blake3 of its rows in primary-key order (text compared
//! bytewise on both sides: SQLite's BINARY, PostgreSQL's `COLLATE "C"`; NULLs first), each row
//! its copied columns in SQLite's order, each value canonical: NULL is `00`; an integer
//! (booleans as 0 and 1) is `01` and 8 bytes big-endian; a float is `02` and its IEEE bits
//! (NaN as one pattern); text is `03`, its UTF-8 length as 8 bytes big-endian, its bytes; a
//! blob is `04`, length, bytes. Computed from SQLite's values as stored and from PostgreSQL's
//! as read back, so a row lost, doubled or changed in any value shows.
//!
//! Deliberately absent: blobs (`<state>/artifacts`) and key files stay where they are — this
//! copies database rows only.

use crate::PgStore;
use postgres::binary_copy::{BinaryCopyInWriter, BinaryCopyOutIter, BinaryCopyOutRow};
use postgres::fallible_iterator::FallibleIterator;
use postgres::types::{ToSql, Type};
use rusqlite::types::ValueRef;
use skiff_protocol::migration::{MigrationReport, TableCheck};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The url is not repeated: it may hold a password.
    #[error("the PostgreSQL url is malformed: {reason}")]
    Url { reason: String },
    #[error("no Skiff state at {path}: the file does not exist")]
    SourceMissing { path: String },
    #[error("cannot read the Skiff state at {path}: {source}")]
    SourceOpen {
        path: String,
        #[source]
        source: rusqlite::Error,
    },
    #[error(
        "the state at {path} is at schema version {found}, newer than this Skiff knows ({known}); migrate it with the Skiff that wrote it"
    )]
    SourceNewer {
        path: String,
        found: usize,
        known: usize,
    },
    #[error("reading the SQLite state: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// Connecting to PostgreSQL or bringing its schema up to date.
    #[error("{0}")]
    Store(#[from] crate::Error),
    #[error("PostgreSQL refused {doing}: {detail}")]
    Postgres { doing: String, detail: String },
    #[error(
        "the target database is not empty: table {table} has {rows} row(s); migrate into a new, empty database (`createdb`), nothing was copied"
    )]
    TargetNotEmpty { table: String, rows: i64 },
    #[error(
        "PostgreSQL has no table {table}, which the SQLite state has; nothing was copied (this Skiff's PostgreSQL schema does not hold it yet)"
    )]
    MissingTable { table: String },
    #[error(
        "PostgreSQL's table {table} has no column {column}, which the SQLite state has; nothing was copied (this Skiff's PostgreSQL schema does not hold it yet)"
    )]
    MissingColumn { table: String, column: String },
    #[error(
        "column {table}.{column} is of type {pg_type} in PostgreSQL, which the copy does not know how to fill; nothing was copied"
    )]
    UnsupportedType {
        table: String,
        column: String,
        pg_type: String,
    },
    #[error(
        "PostgreSQL's column {table}.{column} needs a value (NOT NULL without a default) that the SQLite state does not have; nothing was copied"
    )]
    UnfilledColumn { table: String, column: String },
    #[error(
        "row {key} of table {table}: column {column} holds {found} where PostgreSQL keeps {expected}; correct that row in the SQLite state, then migrate again (nothing was copied)"
    )]
    BadValue {
        table: String,
        column: String,
        key: String,
        found: String,
        expected: &'static str,
    },
    #[error("PostgreSQL refused the rows of table {table}, so nothing was copied: {detail}")]
    Copy { table: String, detail: String },
    #[error("the tables' foreign keys form a cycle ({tables}); nothing was copied")]
    Cycle { tables: String },
    #[error(
        "verification failed on table {table}: {}; the copy was rolled back and the target left empty",
        mismatch(report, table)
    )]
    Mismatch {
        table: String,
        report: Box<MigrationReport>,
    },
}

fn mismatch(report: &MigrationReport, table: &str) -> String {
    match report.tables.iter().find(|t| t.table == table) {
        Some(t) if t.sqlite_rows != t.postgres_rows => format!(
            "{} rows in SQLite, {} read back from PostgreSQL",
            t.sqlite_rows, t.postgres_rows
        ),
        Some(_) => "the same number of rows, but their checksums differ".to_owned(),
        None => "it was not read back".to_owned(),
    }
}

pub type Result<T> = std::result::Result<T, CopyError>;

/// What the copy is doing, for a progress display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Copying,
    Verifying,
}

#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub table: &'a str,
    pub stage: Stage,
    /// Rows done of `total` in this table and stage.
    pub done: u64,
    pub total: u64,
}

/// How often a long table reports progress.
const PROGRESS_EVERY: u64 = 5_000;
/// How long connecting may take when the url does not say (`connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The row PostgreSQL's schema seeds (the gateway's first admin, as SQLite's does): the copy
/// replaces it with the state's own.
const SEEDED_USER: &str = "usr_admin";
/// PostgreSQL-only bookkeeping holding a row from the start; filled by the copy, not checked.
const BOOKKEEPING: &[&str] = &["skiff_schema", "audit_next"];

/// `url` with its password (in the user part or a `password=` parameter) as `***`: what may
/// be printed. Mirrors how the `postgres` crate reads a url, so what it takes for the password
/// is what is hidden; a string that is not a `postgres://` url is not shown at all.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|p| url.strip_prefix(p).map(|rest| (*p, rest)))
    else {
        return "(a connection string, not shown)".to_owned();
    };
    let mut out = String::from(scheme);
    let rest = match rest.find('@') {
        Some(at) => {
            let (creds, tail) = rest.split_at(at);
            match creds.split_once(':') {
                Some((user, _)) => {
                    out.push_str(user);
                    out.push_str(":***");
                }
                None => out.push_str(creds),
            }
            tail
        }
        None => rest,
    };
    match rest.split_once('?') {
        None => out.push_str(rest),
        Some((head, params)) => {
            out.push_str(head);
            out.push('?');
            let params: Vec<String> = params
                .split('&')
                .map(|param| match param.split_once('=') {
                    Some((key, _)) if decoded(key) == "password" => format!("{key}=***"),
                    _ => param.to_owned(),
                })
                .collect();
            out.push_str(&params.join("&"));
        }
    }
    mask_password_parameters(&out)
}

/// Any `password=…` left (in a part the url parser would not read as parameters, such as a
/// malformed url's host) masked up to the next `&`: shown, it could still be the password.
fn mask_password_parameters(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.to_ascii_lowercase().find("password=") {
        let value = at + "password=".len();
        out.push_str(&rest[..value]);
        let end = rest[value..].find('&').map_or(rest.len(), |e| value + e);
        out.push_str("***");
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// A url part percent-decoded (lossily: only compared against an ASCII name).
fn decoded(part: &str) -> String {
    let bytes = part.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(u8::try_from(hi * 16 + lo).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses `url` as the store will, with the reason (never the url) when it does not parse.
pub fn parse_url(url: &str) -> Result<postgres::Config> {
    url.parse::<postgres::Config>().map_err(|e| CopyError::Url {
        reason: std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string),
    })
}

/// A PostgreSQL error with what the server said (its message and detail).
fn pg_detail(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{} ({detail})", db.message()),
            None => db.message().to_owned(),
        },
        None => match std::error::Error::source(e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    }
}

fn refused(doing: impl Into<String>) -> impl FnOnce(postgres::Error) -> CopyError {
    let doing = doing.into();
    move |e| CopyError::Postgres {
        doing,
        detail: pg_detail(&e),
    }
}

/// How a column's values travel: its PostgreSQL type, as far as the copy knows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Int8,
    Int4,
    Int2,
    Bool,
    Float8,
    Text,
    Bytes,
}

impl Kind {
    /// From `information_schema.columns.data_type`.
    fn of(data_type: &str) -> Option<Kind> {
        Some(match data_type {
            "bigint" => Kind::Int8,
            "integer" => Kind::Int4,
            "smallint" => Kind::Int2,
            "boolean" => Kind::Bool,
            "double precision" => Kind::Float8,
            "text" | "character varying" => Kind::Text,
            "bytea" => Kind::Bytes,
            _ => return None,
        })
    }

    fn pg(self) -> Type {
        match self {
            Kind::Int8 => Type::INT8,
            Kind::Int4 => Type::INT4,
            Kind::Int2 => Type::INT2,
            Kind::Bool => Type::BOOL,
            Kind::Float8 => Type::FLOAT8,
            Kind::Text => Type::TEXT,
            Kind::Bytes => Type::BYTEA,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Int8 => "a bigint",
            Kind::Int4 => "an integer",
            Kind::Int2 => "a smallint",
            Kind::Bool => "a boolean (0 or 1)",
            Kind::Float8 => "a double precision number",
            Kind::Text => "UTF-8 text without NUL characters",
            Kind::Bytes => "bytes",
        }
    }
}

/// A PostgreSQL column as its schema describes it.
struct PgColumn {
    name: String,
    kind: Option<Kind>,
    data_type: String,
    /// NULL, a default or an identity fills it when the copy gives no value.
    fills_itself: bool,
    identity: bool,
}

/// The target's schema: its tables' columns and the foreign keys between tables.
struct PgSchema {
    tables: BTreeMap<String, Vec<PgColumn>>,
    /// (child, parent) table pairs.
    references: BTreeSet<(String, String)>,
}

fn read_pg_schema(tx: &mut postgres::Transaction<'_>) -> Result<PgSchema> {
    let mut tables: BTreeMap<String, Vec<PgColumn>> = BTreeMap::new();
    for row in tx
        .query(
            "SELECT t.table_name::text FROM information_schema.tables t
             WHERE t.table_schema = current_schema() AND t.table_type = 'BASE TABLE'",
            &[],
        )
        .map_err(refused("listing the target's tables"))?
    {
        tables.insert(row.get(0), Vec::new());
    }
    for row in tx
        .query(
            "SELECT table_name::text, column_name::text, data_type::text,
                    is_nullable = 'YES' OR column_default IS NOT NULL
                        OR is_identity = 'YES' OR is_generated = 'ALWAYS',
                    is_identity = 'YES'
             FROM information_schema.columns
             WHERE table_schema = current_schema()
             ORDER BY table_name, ordinal_position",
            &[],
        )
        .map_err(refused("listing the target's columns"))?
    {
        let table: String = row.get(0);
        let data_type: String = row.get(2);
        if let Some(columns) = tables.get_mut(&table) {
            columns.push(PgColumn {
                name: row.get(1),
                kind: Kind::of(&data_type),
                data_type,
                fills_itself: row.get(3),
                identity: row.get(4),
            });
        }
    }
    let references = tx
        .query(
            "SELECT c.relname::text, p.relname::text FROM pg_constraint k
             JOIN pg_class c ON c.oid = k.conrelid JOIN pg_class p ON p.oid = k.confrelid
             WHERE k.contype = 'f' AND k.connamespace = current_schema()::regnamespace",
            &[],
        )
        .map_err(refused("listing the target's foreign keys"))?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    Ok(PgSchema { tables, references })
}

/// A table to copy: its columns (SQLite's, in SQLite's order) with their PostgreSQL kinds.
struct Table {
    name: String,
    columns: Vec<(String, Kind)>,
    /// Indexes into `columns` of the primary key, in key order (every column when there is
    /// none).
    key: Vec<usize>,
    /// Whether SQLite keeps a rowid (creation order) for it.
    rowid: bool,
    /// Copied columns PostgreSQL numbers by identity: its sequence is moved past them.
    identities: Vec<String>,
}

/// `name` as an SQL identifier (the same quoting in SQLite and PostgreSQL).
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl Table {
    fn column_list(&self) -> String {
        self.columns
            .iter()
            .map(|(name, _)| ident(name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The primary-key order: bytewise text on both sides, NULLs first (SQLite's way).
    fn key_order(&self, postgres: bool) -> String {
        self.key
            .iter()
            .map(|&i| {
                let (name, kind) = &self.columns[i];
                match (postgres, kind) {
                    (true, Kind::Text) => format!("{} COLLATE \"C\" NULLS FIRST", ident(name)),
                    (true, _) => format!("{} NULLS FIRST", ident(name)),
                    (false, Kind::Text) => format!("{} COLLATE BINARY", ident(name)),
                    (false, _) => ident(name),
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The row's key as a person reads it (`session_id=ses_…, seq=3`).
    fn describe_key(&self, row: &rusqlite::Row<'_>) -> String {
        self.key
            .iter()
            .map(|&i| {
                let value = match row.get_ref(i) {
                    Ok(ValueRef::Null) => "NULL".to_owned(),
                    Ok(ValueRef::Integer(n)) => n.to_string(),
                    Ok(ValueRef::Real(f)) => f.to_string(),
                    Ok(ValueRef::Text(t)) => String::from_utf8_lossy(t).into_owned(),
                    Ok(ValueRef::Blob(b)) => format!("a blob of {} bytes", b.len()),
                    Err(_) => "?".to_owned(),
                };
                format!("{}={value}", self.columns[i].0)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// SQLite's tables in creation order, each checked against PostgreSQL's.
fn plan(src: &rusqlite::Connection, pg: &PgSchema) -> Result<Vec<Table>> {
    let names: Vec<String> = src
        .prepare(
            "SELECT name FROM sqlite_master WHERE type = 'table'
             AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY rowid",
        )?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let mut tables = Vec::new();
    for name in names {
        let Some(pg_columns) = pg.tables.get(&name) else {
            return Err(CopyError::MissingTable { table: name });
        };
        let sqlite_columns: Vec<(String, i64)> = src
            .prepare("SELECT name, pk FROM pragma_table_info(?1) ORDER BY cid")?
            .query_map([&name], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        let mut columns = Vec::new();
        let mut identities = Vec::new();
        for (column, _) in &sqlite_columns {
            let Some(pg_column) = pg_columns.iter().find(|c| &c.name == column) else {
                return Err(CopyError::MissingColumn {
                    table: name,
                    column: column.clone(),
                });
            };
            let Some(kind) = pg_column.kind else {
                return Err(CopyError::UnsupportedType {
                    table: name,
                    column: column.clone(),
                    pg_type: pg_column.data_type.clone(),
                });
            };
            if pg_column.identity {
                identities.push(column.clone());
            }
            columns.push((column.clone(), kind));
        }
        if let Some(unfilled) = pg_columns
            .iter()
            .find(|c| !c.fills_itself && !sqlite_columns.iter().any(|(s, _)| s == &c.name))
        {
            return Err(CopyError::UnfilledColumn {
                table: name,
                column: unfilled.name.clone(),
            });
        }
        let mut key: Vec<(i64, usize)> = sqlite_columns
            .iter()
            .enumerate()
            .filter(|(_, (_, pk))| *pk > 0)
            .map(|(i, (_, pk))| (*pk, i))
            .collect();
        key.sort_unstable();
        let mut key: Vec<usize> = key.into_iter().map(|(_, i)| i).collect();
        if key.is_empty() {
            key = (0..columns.len()).collect();
        }
        let rowid = src
            .prepare(&format!("SELECT rowid FROM {} LIMIT 0", ident(&name)))
            .is_ok();
        tables.push(Table {
            name,
            columns,
            key,
            rowid,
            identities,
        });
    }
    in_reference_order(tables, &pg.references)
}

/// Parents before the tables whose foreign keys name them; otherwise creation order.
fn in_reference_order(
    mut pending: Vec<Table>,
    references: &BTreeSet<(String, String)>,
) -> Result<Vec<Table>> {
    let mut ordered: Vec<Table> = Vec::with_capacity(pending.len());
    while !pending.is_empty() {
        let ready = pending.iter().position(|table| {
            references.iter().all(|(child, parent)| {
                child != &table.name
                    || parent == child
                    || !pending.iter().any(|other| &other.name == parent)
            })
        });
        match ready {
            Some(i) => ordered.push(pending.remove(i)),
            None => {
                return Err(CopyError::Cycle {
                    tables: pending
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
    }
    Ok(ordered)
}

/// One value on its way to PostgreSQL, typed as its column there.
enum Value {
    Int8(Option<i64>),
    Int4(Option<i32>),
    Int2(Option<i16>),
    Bool(Option<bool>),
    Float8(Option<f64>),
    Text(Option<String>),
    Bytes(Option<Vec<u8>>),
}

impl Value {
    fn as_sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Value::Int8(v) => v,
            Value::Int4(v) => v,
            Value::Int2(v) => v,
            Value::Bool(v) => v,
            Value::Float8(v) => v,
            Value::Text(v) => v,
            Value::Bytes(v) => v,
        }
    }

    /// SQLite's value as `kind`; `None` when it is not one (the caller names the row).
    fn from_sqlite(value: ValueRef<'_>, kind: Kind) -> Option<Value> {
        Some(match (value, kind) {
            (ValueRef::Null, Kind::Int8) => Value::Int8(None),
            (ValueRef::Null, Kind::Int4) => Value::Int4(None),
            (ValueRef::Null, Kind::Int2) => Value::Int2(None),
            (ValueRef::Null, Kind::Bool) => Value::Bool(None),
            (ValueRef::Null, Kind::Float8) => Value::Float8(None),
            (ValueRef::Null, Kind::Text) => Value::Text(None),
            (ValueRef::Null, Kind::Bytes) => Value::Bytes(None),
            (ValueRef::Integer(n), Kind::Int8) => Value::Int8(Some(n)),
            (ValueRef::Integer(n), Kind::Int4) => Value::Int4(Some(i32::try_from(n).ok()?)),
            (ValueRef::Integer(n), Kind::Int2) => Value::Int2(Some(i16::try_from(n).ok()?)),
            (ValueRef::Integer(0), Kind::Bool) => Value::Bool(Some(false)),
            (ValueRef::Integer(1), Kind::Bool) => Value::Bool(Some(true)),
            (ValueRef::Integer(n), Kind::Float8) => Value::Float8(Some(exact_float(n)?)),
            (ValueRef::Real(f), Kind::Float8) => Value::Float8(Some(f)),
            (ValueRef::Text(t), Kind::Text) if !t.contains(&0) => {
                Value::Text(Some(String::from_utf8(t.to_vec()).ok()?))
            }
            (ValueRef::Blob(b), Kind::Bytes) => Value::Bytes(Some(b.to_vec())),
            _ => return None,
        })
    }
}

/// An integer a float holds exactly.
fn exact_float(n: i64) -> Option<f64> {
    let f = n as f64;
    (f as i64 == n).then_some(f)
}

/// What a value is, for an error message (never the value: it may be anything).
fn describe_value(value: ValueRef<'_>) -> String {
    match value {
        ValueRef::Null => "NULL".to_owned(),
        ValueRef::Integer(n) => format!("the integer {n}"),
        ValueRef::Real(_) => "a floating-point number".to_owned(),
        ValueRef::Text(t) if t.contains(&0) => "text with a NUL character".to_owned(),
        ValueRef::Text(t) if std::str::from_utf8(t).is_err() => "text that is not UTF-8".to_owned(),
        ValueRef::Text(_) => "text".to_owned(),
        ValueRef::Blob(b) => format!("a blob of {} bytes", b.len()),
    }
}

/// The canonical form of rows (see the module's comment), hashed.
struct Checksum {
    hasher: blake3::Hasher,
    rows: u64,
}

impl Checksum {
    fn new() -> Self {
        Self {
            hasher: blake3::Hasher::new(),
            rows: 0,
        }
    }

    fn null(&mut self) {
        self.hasher.update(&[0]);
    }

    fn int(&mut self, n: i64) {
        self.hasher.update(&[1]);
        self.hasher.update(&n.to_be_bytes());
    }

    fn float(&mut self, f: f64) {
        let bits = if f.is_nan() {
            f64::NAN.to_bits()
        } else {
            f.to_bits()
        };
        self.hasher.update(&[2]);
        self.hasher.update(&bits.to_be_bytes());
    }

    fn text(&mut self, bytes: &[u8]) {
        self.sized(3, bytes);
    }

    fn blob(&mut self, bytes: &[u8]) {
        self.sized(4, bytes);
    }

    fn sized(&mut self, tag: u8, bytes: &[u8]) {
        let len = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
        self.hasher.update(&[tag]);
        self.hasher.update(&len.to_be_bytes());
        self.hasher.update(bytes);
    }

    /// A value as SQLite stores it, in a column PostgreSQL keeps as `kind`.
    fn sqlite(&mut self, value: ValueRef<'_>, kind: Kind) {
        match value {
            ValueRef::Null => self.null(),
            ValueRef::Integer(n) if kind == Kind::Float8 => match exact_float(n) {
                Some(f) => self.float(f),
                None => self.int(n),
            },
            ValueRef::Integer(n) => self.int(n),
            ValueRef::Real(f) => self.float(f),
            ValueRef::Text(t) => self.text(t),
            ValueRef::Blob(b) => self.blob(b),
        }
    }

    /// Column `i` of a row read back from PostgreSQL.
    fn postgres(&mut self, row: &BinaryCopyOutRow, i: usize, kind: Kind) -> Result<()> {
        let read = |e: postgres::Error| CopyError::Postgres {
            doing: "reading the copy back".to_owned(),
            detail: pg_detail(&e),
        };
        match kind {
            Kind::Int8 => self.optional(row.try_get::<Option<i64>>(i).map_err(read)?, Self::int),
            Kind::Int4 => self.optional(row.try_get::<Option<i32>>(i).map_err(read)?, |c, n| {
                c.int(i64::from(n));
            }),
            Kind::Int2 => self.optional(row.try_get::<Option<i16>>(i).map_err(read)?, |c, n| {
                c.int(i64::from(n));
            }),
            Kind::Bool => self.optional(row.try_get::<Option<bool>>(i).map_err(read)?, |c, b| {
                c.int(i64::from(b));
            }),
            Kind::Float8 => {
                self.optional(row.try_get::<Option<f64>>(i).map_err(read)?, Self::float);
            }
            Kind::Text => self.optional(row.try_get::<Option<&str>>(i).map_err(read)?, |c, t| {
                c.text(t.as_bytes());
            }),
            Kind::Bytes => {
                self.optional(row.try_get::<Option<&[u8]>>(i).map_err(read)?, Self::blob);
            }
        }
        Ok(())
    }

    fn optional<T>(&mut self, value: Option<T>, some: impl FnOnce(&mut Self, T)) {
        match value {
            Some(v) => some(self, v),
            None => self.null(),
        }
    }

    fn hex(&self) -> String {
        self.hasher.finalize().to_hex().to_string()
    }
}

/// Copies the SQLite state at `sqlite` into the empty PostgreSQL database at `url` (see the
/// module's comment), telling `progress` as it goes. On success every table's counts and
/// checksums agreed and the copy is committed; on any error nothing was left in the target.
///
/// Blocking, and not to be called on a tokio runtime's thread (the `postgres` client runs its
/// own runtime): the CLI calls it from a thread of its own.
pub fn copy_to_postgres(
    sqlite: &Path,
    url: &str,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<MigrationReport> {
    let started = Instant::now();
    let mut config = parse_url(url)?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name("skiff-migrate");
    }
    let src = open_source(sqlite)?;
    // This Skiff's schema, made the way a gateway makes it (then this connection is done).
    drop(PgStore::connect(url)?);
    let mut client = config
        .connect(postgres::NoTls)
        .map_err(refused("the connection"))?;
    let mut tx = client
        .transaction()
        .map_err(refused("starting a transaction"))?;
    let schema = read_pg_schema(&mut tx)?;
    lock_and_check_empty(&mut tx, &schema)?;
    let tables = plan(&src, &schema)?;
    if tables.iter().any(|t| t.name == "users") {
        tx.execute("DELETE FROM users WHERE id = $1", &[&SEEDED_USER])
            .map_err(refused("clearing the seeded first admin"))?;
    }
    for table in &tables {
        copy_table(&mut tx, &src, table, progress)?;
    }
    set_counters(&mut tx, &schema, &tables)?;
    let mut report = MigrationReport {
        source: sqlite.display().to_string(),
        target: redact_url(url),
        tables: Vec::new(),
        committed: false,
        elapsed_ms: 0,
    };
    for table in &tables {
        report
            .tables
            .push(verify_table(&mut tx, &src, table, progress)?);
    }
    report.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    if let Some(bad) = report.tables.iter().find(|t| !t.matches()) {
        // Dropping the transaction rolls everything back.
        return Err(CopyError::Mismatch {
            table: bad.table.clone(),
            report: Box::new(report),
        });
    }
    tx.commit().map_err(refused("committing the copy"))?;
    report.committed = true;
    // Freshly loaded tables have no planner statistics until autovacuum comes round; the
    // gateway's first queries would be planned blind. The copy stands whether this works or
    // not, so a failure here is not one of the migration's.
    let _ = client.batch_execute("ANALYZE");
    report.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    Ok(report)
}

/// The state read-only, inside one read transaction: a consistent snapshot. A state from an
/// older Skiff is first brought to this one's schema, as the gateway would on start.
fn open_source(path: &Path) -> Result<rusqlite::Connection> {
    if !path.exists() {
        return Err(CopyError::SourceMissing {
            path: path.display().to_string(),
        });
    }
    let open_err = |source| CopyError::SourceOpen {
        path: path.display().to_string(),
        source,
    };
    let known = {
        let mut fresh = rusqlite::Connection::open_in_memory()?;
        crate::migrations::migrate(&mut fresh).map_err(CopyError::Store)?;
        user_version(&fresh)?
    };
    let open = || {
        let conn = rusqlite::Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(open_err)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        Ok::<_, CopyError>(conn)
    };
    let found = user_version(&open()?).map_err(|e| match e {
        CopyError::Sqlite(source) => open_err(source),
        other => other,
    })?;
    if found > known {
        return Err(CopyError::SourceNewer {
            path: path.display().to_string(),
            found,
            known,
        });
    }
    if found < known {
        drop(crate::Store::open(path)?);
    }
    let conn = open()?;
    conn.execute_batch("BEGIN DEFERRED")?;
    Ok(conn)
}

fn user_version(conn: &rusqlite::Connection) -> Result<usize> {
    Ok(conn.pragma_query_value(None, "user_version", |r| r.get(0))?)
}

/// Locks every table of the target against other writers (readers still read) until the
/// copy commits or rolls back, then refuses it if any holds a row.
fn lock_and_check_empty(tx: &mut postgres::Transaction<'_>, schema: &PgSchema) -> Result<()> {
    let all: Vec<String> = schema.tables.keys().map(|t| ident(t)).collect();
    if !all.is_empty() {
        tx.batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", all.join(", ")))
            .map_err(refused("locking the target's tables"))?;
    }
    for table in schema.tables.keys() {
        if BOOKKEEPING.contains(&table.as_str()) {
            continue;
        }
        let count = format!("SELECT count(*) FROM {}", ident(table));
        let rows = if table == "users" {
            tx.query_one(&format!("{count} WHERE id <> $1"), &[&SEEDED_USER])
        } else {
            tx.query_one(&count, &[])
        };
        let rows: i64 = rows
            .map_err(refused(format!("counting the rows of {table}")))?
            .get(0);
        if rows > 0 {
            return Err(CopyError::TargetNotEmpty {
                table: table.clone(),
                rows,
            });
        }
    }
    Ok(())
}

fn copy_table(
    tx: &mut postgres::Transaction<'_>,
    src: &rusqlite::Connection,
    table: &Table,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<()> {
    let total = count_rows(src, table)?;
    let mut tell = |done| {
        progress(Progress {
            table: &table.name,
            stage: Stage::Copying,
            done,
            total,
        });
    };
    tell(0);
    let columns = table.column_list();
    let order = if table.rowid {
        "rowid".to_owned()
    } else {
        table.key_order(false)
    };
    let mut read = src.prepare(&format!(
        "SELECT {columns} FROM {} ORDER BY {order}",
        ident(&table.name)
    ))?;
    let failed = |e: postgres::Error| CopyError::Copy {
        table: table.name.clone(),
        detail: pg_detail(&e),
    };
    let types: Vec<Type> = table.columns.iter().map(|(_, kind)| kind.pg()).collect();
    let sink = tx
        .copy_in(&format!(
            "COPY {} ({columns}) FROM STDIN (FORMAT binary)",
            ident(&table.name)
        ))
        .map_err(failed)?;
    let mut sink = BinaryCopyInWriter::new(sink, &types);
    let mut rows = read.query([])?;
    let mut values: Vec<Value> = Vec::with_capacity(table.columns.len());
    let mut done = 0u64;
    while let Some(row) = rows.next()? {
        values.clear();
        for (i, (column, kind)) in table.columns.iter().enumerate() {
            let raw = row.get_ref(i)?;
            match Value::from_sqlite(raw, *kind) {
                Some(value) => values.push(value),
                None => {
                    return Err(CopyError::BadValue {
                        table: table.name.clone(),
                        column: column.clone(),
                        key: table.describe_key(row),
                        found: describe_value(raw),
                        expected: kind.name(),
                    });
                }
            }
        }
        let refs: Vec<&(dyn ToSql + Sync)> = values.iter().map(Value::as_sql).collect();
        sink.write(&refs).map_err(failed)?;
        done += 1;
        if done.is_multiple_of(PROGRESS_EVERY) {
            tell(done);
        }
    }
    sink.finish().map_err(failed)?;
    tell(done);
    Ok(())
}

fn count_rows(src: &rusqlite::Connection, table: &Table) -> Result<u64> {
    let n: i64 = src.query_row(
        &format!("SELECT count(*) FROM {}", ident(&table.name)),
        [],
        |r| r.get(0),
    )?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// The database's own counters, moved past the copied rows so new writes continue after
/// them: each session's event cursor, the audit id, and identity sequences of copied columns.
fn set_counters(
    tx: &mut postgres::Transaction<'_>,
    schema: &PgSchema,
    tables: &[Table],
) -> Result<()> {
    let copied = |name: &str| tables.iter().any(|t| t.name == name);
    if schema.tables.contains_key("event_cursors") && copied("events") {
        tx.execute(
            "INSERT INTO event_cursors (session_id, last_seq)
             SELECT session_id, MAX(seq) FROM events GROUP BY session_id",
            &[],
        )
        .map_err(refused("setting the event cursors"))?;
    }
    if schema.tables.contains_key("audit_next") && copied("audit") {
        tx.execute(
            "UPDATE audit_next SET last = (SELECT COALESCE(MAX(id), 0) FROM audit)",
            &[],
        )
        .map_err(refused("setting the next audit id"))?;
    }
    for table in tables {
        for column in &table.identities {
            tx.execute(
                &format!(
                    "SELECT setval(pg_get_serial_sequence($1, $2), MAX({col})) FROM {t}
                     HAVING MAX({col}) IS NOT NULL",
                    col = ident(column),
                    t = ident(&table.name),
                ),
                &[&ident(&table.name), column],
            )
            .map_err(refused(format!(
                "moving the sequence of {}.{column}",
                table.name
            )))?;
        }
    }
    Ok(())
}

/// The table's rows and checksum read from SQLite (the snapshot the copy read) and from
/// PostgreSQL (inside the copy's transaction).
fn verify_table(
    tx: &mut postgres::Transaction<'_>,
    src: &rusqlite::Connection,
    table: &Table,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<TableCheck> {
    let columns = table.column_list();
    let mut sqlite = Checksum::new();
    let mut read = src.prepare(&format!(
        "SELECT {columns} FROM {} ORDER BY {}",
        ident(&table.name),
        table.key_order(false)
    ))?;
    let mut rows = read.query([])?;
    while let Some(row) = rows.next()? {
        for (i, (_, kind)) in table.columns.iter().enumerate() {
            sqlite.sqlite(row.get_ref(i)?, *kind);
        }
        sqlite.rows += 1;
    }
    let total = sqlite.rows;
    let mut tell = |done| {
        progress(Progress {
            table: &table.name,
            stage: Stage::Verifying,
            done,
            total,
        });
    };
    tell(0);
    let mut postgres = Checksum::new();
    let types: Vec<Type> = table.columns.iter().map(|(_, kind)| kind.pg()).collect();
    let reading = |e: postgres::Error| CopyError::Postgres {
        doing: format!("reading {} back", table.name),
        detail: pg_detail(&e),
    };
    let out = tx
        .copy_out(&format!(
            "COPY (SELECT {columns} FROM {} ORDER BY {}) TO STDOUT (FORMAT binary)",
            ident(&table.name),
            table.key_order(true)
        ))
        .map_err(reading)?;
    let mut back = BinaryCopyOutIter::new(out, &types);
    while let Some(row) = back.next().map_err(reading)? {
        for (i, (_, kind)) in table.columns.iter().enumerate() {
            postgres.postgres(&row, i, *kind)?;
        }
        postgres.rows += 1;
        if postgres.rows.is_multiple_of(PROGRESS_EVERY) {
            tell(postgres.rows);
        }
    }
    tell(postgres.rows);
    Ok(TableCheck {
        table: table.name.clone(),
        sqlite_rows: sqlite.rows,
        postgres_rows: postgres.rows,
        sqlite_checksum: sqlite.hex(),
        postgres_checksum: postgres.hex(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_shown_without_its_password() {
        for (url, shown) in [
            (
                "postgres://skiff:hunter2@db.example:5432/skiff",
                "postgres://skiff:***@db.example:5432/skiff",
            ),
            (
                "postgresql://skiff@%2Frun%2Fpg/app?password=hunter2&sslmode=disable",
                "postgresql://skiff@%2Frun%2Fpg/app?password=***&sslmode=disable",
            ),
            (
                "postgres://a:b:c%40hunter2@h/d?pass%77ord=hunter2",
                "postgres://a:***@h/d?pass%77ord=***",
            ),
            ("postgres://h/d", "postgres://h/d"),
            (
                "postgres://h/d?user=a@b&password=hunter2",
                "postgres://h/d?user=a@b&password=***",
            ),
            (
                "host=/run/pg password=hunter2",
                "(a connection string, not shown)",
            ),
        ] {
            let redacted = redact_url(url);
            assert_eq!(redacted, shown);
            assert!(!redacted.contains("hunter2"), "{redacted}");
        }
    }

    #[test]
    fn a_malformed_url_says_why_without_repeating_it() {
        let err = parse_url("postgres://skiff:hunter2@host:notaport/db").unwrap_err();
        let said = err.to_string();
        assert!(said.contains("port"), "{said}");
        assert!(!said.contains("hunter2"), "{said}");
    }

    #[test]
    fn the_canonical_form_is_the_same_for_a_value_from_either_side() {
        // A boolean stored by SQLite as 1 and read back by PostgreSQL as true; an integer in
        // a float column; text and a blob with the same bytes differ.
        let mut a = Checksum::new();
        a.sqlite(ValueRef::Integer(1), Kind::Bool);
        a.sqlite(ValueRef::Integer(3), Kind::Float8);
        a.sqlite(ValueRef::Text(b"x"), Kind::Text);
        let mut b = Checksum::new();
        b.int(i64::from(true));
        b.float(3.0);
        b.text(b"x");
        assert_eq!(a.hex(), b.hex());
        let mut c = Checksum::new();
        c.int(1);
        c.float(3.0);
        c.blob(b"x");
        assert_ne!(a.hex(), c.hex());
        // NULL is not the empty string, nor zero.
        let (mut null, mut empty, mut zero) = (Checksum::new(), Checksum::new(), Checksum::new());
        null.null();
        empty.text(b"");
        zero.int(0);
        assert_ne!(null.hex(), empty.hex());
        assert_ne!(null.hex(), zero.hex());
    }
}
