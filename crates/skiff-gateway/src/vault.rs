//! The vault: provider keys and other secrets sealed with AES-256-GCM under a key kept outside
//! the database, and its admin-only routes (`/v1/secrets`).
//!
//! Each secret gets a random 96-bit nonce, and its name is the AAD, so a ciphertext moved to
//! another name does not open. The key is `SKIFF_VAULT_KEY` (base64 of 32 bytes) or
//! `<state>/vault.key` (the same text, created 0600 by the first `secret set`, refused when group
//! or others may read it); both at once is refused rather than guessed between. Each row names
//! the key that sealed it (`key_id`, a hash of the key), so opening picks the right key and a
//! wrong one is told apart from altered bytes.
//!
//! Rotation with a key file, in this order, so a crash at any point leaves a vault that opens:
//! 1. every secret is opened with the current key (nothing changes if one does not);
//! 2. the current key is written to `vault.key.previous` (temporary file, fsync, rename);
//! 3. the new key replaces `vault.key` the same way;
//! 4. every secret is sealed again under the new key in one transaction;
//! 5. `vault.key.previous` is removed.
//!
//! Loading reads `vault.key` and, if present, `vault.key.previous`: after a crash before step 4
//! committed, rows still name the previous key and open with it, and the first use reseals them
//! under the current key and removes the previous file. With `SKIFF_VAULT_KEY` the gateway
//! cannot change its own environment: it reseals in one transaction, keeps the new key in
//! memory and hands it back once for the operator to set before the next start.
//!
//! Deliberately absent: plaintext anywhere but this process's memory and the response to the
//! process that asked (a provider call's header, setup's stdin); `GET` never returns a value.

use crate::Core;
use crate::error::Error;
use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use axum::extract::{Path as UrlPath, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Json};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use skiff_protocol::secrets::{RotatedKey, SecretList, SecretView, SetSecretRequest};
use skiff_store::{Backend, Resealed, Scope, SecretRow};
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The environment variable that holds the vault key instead of `<state>/vault.key`.
pub const KEY_ENV: &str = "SKIFF_VAULT_KEY";
const KEY_FILE: &str = "vault.key";
const PREVIOUS_KEY_FILE: &str = "vault.key.previous";
const KEY_LEN: usize = 32;
const NONCE_LEN: usize = 12;
const MAX_NAME_LEN: usize = 128;
/// The names the gateway seals for itself (a box's SSH key, see `worker/adopt.rs`): never
/// listed by `secret list`, refused to `secret set`.
pub(crate) const INTERNAL_PREFIX: &str = "_skiff.";

/// What can go wrong with the vault's key or a secret, written for the operator.
#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    #[error(
        "{name:?} is not a secret name: use 1 to {MAX_NAME_LEN} letters, digits, `_`, `-` or `.`, starting with a letter, digit or `_`"
    )]
    InvalidName { name: String },
    #[error("the value of secret `{name}` is empty; pipe the value in on stdin")]
    EmptyValue { name: String },
    #[error(
        "the vault holds no secret `{name}`; set it with `skiff secret set {name}` (value on stdin)"
    )]
    NotFound { name: String },
    #[error(
        "both {KEY_ENV} and {} hold a vault key, and the gateway will not guess which one sealed the secrets: unset {KEY_ENV} or remove the file",
        path.display()
    )]
    TwoKeys { path: PathBuf },
    #[error(
        "{} can be read by other users (mode {mode:04o}); the vault key must be private: chmod 600 {}",
        path.display(),
        path.display()
    )]
    KeyFileMode { path: PathBuf, mode: u32 },
    #[error(
        "the vault key from {source_name} is not usable: {problem} (it must be 32 random bytes in base64, as `head -c 32 /dev/urandom | base64`)"
    )]
    BadKey {
        source_name: String,
        problem: String,
    },
    #[error("cannot {action} the vault key file {}: {source}", path.display())]
    KeyFile {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "secret `{name}` was sealed with another key (id {sealed_with}) than the vault key from {source_name} (id {current}); start the gateway with the key that sealed it, or set the secret again"
    )]
    WrongKey {
        name: String,
        sealed_with: String,
        source_name: String,
        current: String,
    },
    #[error(
        "the vault holds secrets but has no key: {} is missing and {KEY_ENV} is not set; restore the key file or set {KEY_ENV}",
        path.display()
    )]
    NoKey { path: PathBuf },
    #[error(
        "this gateway's vault key (from {source_name}, id {current}) is not the one that sealed the secrets in its shared database (key id {sealed_with}): start it with the same {KEY_ENV} as the other gateways on this database"
    )]
    NotTheDatabasesKey {
        source_name: String,
        current: String,
        sealed_with: String,
    },
    #[error(
        "the shared database holds secrets sealed by another gateway (key id {sealed_with}) and this gateway has no vault key: start it with the same {KEY_ENV} as the other gateways on this database"
    )]
    NoKeyForDatabase { sealed_with: String },
    #[error(
        "the vault holds secrets sealed with another key (id {sealed_with}) than any this gateway has, so it will not make a new key beside them: restore {} or set {KEY_ENV} to the key that sealed them (on a shared database: the other gateways' {KEY_ENV})",
        path.display()
    )]
    WouldSplitKeys { path: PathBuf, sealed_with: String },
    #[error(
        "secret `{name}` does not open with the vault key from {source_name}: its sealed bytes were altered or belong to another secret; set it again"
    )]
    Tampered { name: String, source_name: String },
    #[error("cannot seal secret `{name}`: {problem}")]
    Seal { name: String, problem: String },
}

/// One key, named by its id. Its bytes stay inside the cipher.
#[derive(Clone)]
struct Key {
    id: String,
    cipher: Aes256Gcm,
}

impl Key {
    fn from_bytes(bytes: &[u8], source_name: &str) -> Result<Key, VaultError> {
        let cipher = Aes256Gcm::new_from_slice(bytes).map_err(|_| VaultError::BadKey {
            source_name: source_name.to_owned(),
            problem: format!("it is {} bytes long, not {KEY_LEN}", bytes.len()),
        })?;
        Ok(Key {
            id: key_id(bytes),
            cipher,
        })
    }

    fn parse(text: &str, source_name: &str) -> Result<Key, VaultError> {
        let bytes = BASE64.decode(text.trim()).map_err(|e| VaultError::BadKey {
            source_name: source_name.to_owned(),
            problem: format!("it is not base64 ({e})"),
        })?;
        Key::from_bytes(&bytes, source_name)
    }
}

/// A hash of the key: names it in rows and messages without revealing anything of it.
fn key_id(bytes: &[u8]) -> String {
    blake3::derive_key("skiff vault key id v1", bytes)[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn random<const N: usize>() -> Result<[u8; N], Error> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)
        .map_err(|e| Error::Internal(format!("the system's random source failed: {e}")))?;
    Ok(bytes)
}

/// The keys in use: the current one seals; `previous` (a rotation cut short) only opens.
struct Keyring {
    current: Key,
    previous: Option<Key>,
}

impl Keyring {
    fn find(&self, id: &str) -> Option<&Key> {
        std::iter::once(&self.current)
            .chain(self.previous.as_ref())
            .find(|k| k.id == id)
    }
}

pub(crate) struct Vault {
    store: Arc<dyn Backend>,
    dir: PathBuf,
    /// `SKIFF_VAULT_KEY` as the gateway was started with it.
    env_key: Option<String>,
    /// Loaded at first use; a failure is not kept, so fixing the file's mode needs no restart.
    keys: Mutex<Option<Arc<Keyring>>>,
}

impl std::fmt::Debug for Vault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vault")
            .field("key_source", &self.source_name())
            .finish_non_exhaustive()
    }
}

impl Vault {
    pub(crate) fn new(store: Arc<dyn Backend>, dir: &Path, env_key: Option<String>) -> Vault {
        Vault {
            store,
            dir: dir.to_path_buf(),
            env_key: env_key.filter(|k| !k.trim().is_empty()),
            keys: Mutex::new(None),
        }
    }

    fn key_path(&self) -> PathBuf {
        self.dir.join(KEY_FILE)
    }

    fn previous_path(&self) -> PathBuf {
        self.dir.join(PREVIOUS_KEY_FILE)
    }

    /// Where the key comes from, as messages name it.
    fn source_name(&self) -> String {
        match self.env_key {
            Some(_) => KEY_ENV.to_owned(),
            None => self.key_path().display().to_string(),
        }
    }

    /// The slot that holds the keyring. Held by every operation that seals, so a secret set
    /// beside a rotation is never sealed with the key the rotation is throwing away.
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<Keyring>>> {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The keyring, loaded (and settled after a cut-short rotation) at first use. `None` when
    /// there is no key yet and `create` is false; with `create`, a key file is made.
    fn keyring(
        &self,
        slot: &mut Option<Arc<Keyring>>,
        create: bool,
    ) -> crate::Result<Option<Arc<Keyring>>> {
        if let Some(keys) = slot.as_ref() {
            return Ok(Some(keys.clone()));
        }
        let path = self.key_path();
        if let Some(text) = &self.env_key {
            if path.exists() {
                return Err(VaultError::TwoKeys { path }.into());
            }
            let keys = Arc::new(Keyring {
                current: Key::parse(text, KEY_ENV)?,
                previous: None,
            });
            *slot = Some(keys.clone());
            return Ok(Some(keys));
        }
        let current = match read_key_file(&path)? {
            Some(key) => key,
            None if create => {
                // A key made beside secrets sealed under another (this state dir's lost file,
                // or another gateway's key on a shared database) could never open them, and
                // what it sealed the others could not open.
                if let Some(row) = self.store.secrets()?.first() {
                    return Err(VaultError::WouldSplitKeys {
                        path,
                        sealed_with: row.key_id.clone(),
                    }
                    .into());
                }
                let bytes = random::<KEY_LEN>()?;
                write_key_file(&self.dir, KEY_FILE, &bytes)?;
                Key::from_bytes(&bytes, &self.source_name())?
            }
            None => return Ok(None),
        };
        let mut keys = Keyring {
            current,
            previous: read_key_file(&self.previous_path())?,
        };
        if keys.previous.is_some() {
            self.settle(&keys)?;
            keys.previous = None;
        }
        let keys = Arc::new(keys);
        *slot = Some(keys.clone());
        Ok(Some(keys))
    }

    /// Finishes a rotation a crash cut short: rows still sealed with the previous key are
    /// sealed under the current one (one transaction), then the previous key file goes.
    fn settle(&self, keys: &Keyring) -> crate::Result<()> {
        let resealed = reseal(&*self.store, |row| {
            if row.key_id == keys.current.id {
                return Ok(Resealed {
                    ciphertext: row.ciphertext.clone(),
                    nonce: row.nonce.clone(),
                    key_id: row.key_id.clone(),
                });
            }
            let plain = self.open_row(keys, row)?;
            seal(&keys.current, &row.name, &plain)
        })?;
        remove_key_file(&self.dir, PREVIOUS_KEY_FILE)?;
        tracing::warn!(
            secrets = resealed,
            "finished a vault key rotation a previous gateway left unfinished"
        );
        Ok(())
    }

    fn open_row(&self, keys: &Keyring, row: &SecretRow) -> crate::Result<String> {
        let Some(key) = keys.find(&row.key_id) else {
            return Err(VaultError::WrongKey {
                name: row.name.clone(),
                sealed_with: row.key_id.clone(),
                source_name: self.source_name(),
                current: keys.current.id.clone(),
            }
            .into());
        };
        let tampered = || VaultError::Tampered {
            name: row.name.clone(),
            source_name: self.source_name(),
        };
        if row.nonce.len() != NONCE_LEN {
            return Err(tampered().into());
        }
        let plain = key
            .cipher
            .decrypt(
                Nonce::from_slice(&row.nonce),
                Payload {
                    msg: &row.ciphertext,
                    aad: row.name.as_bytes(),
                },
            )
            .map_err(|_| tampered())?;
        String::from_utf8(plain).map_err(|_| tampered().into())
    }

    /// On a database other gateways share: refuses a key that does not open what is sealed
    /// there, so that no gateway seals what the others cannot open. Names key ids, never a key.
    pub(crate) fn check_shared_database(&self) -> crate::Result<()> {
        // The keyring first: loading it may finish a rotation, which reseals the rows.
        let keys = self.keyring(&mut self.slot(), false)?;
        let rows = self.store.secrets()?;
        let Some(keys) = keys else {
            return match rows.first() {
                Some(row) => Err(VaultError::NoKeyForDatabase {
                    sealed_with: row.key_id.clone(),
                }
                .into()),
                None => Ok(()),
            };
        };
        match rows.iter().find(|row| keys.find(&row.key_id).is_none()) {
            Some(row) => Err(VaultError::NotTheDatabasesKey {
                source_name: self.source_name(),
                current: keys.current.id.clone(),
                sealed_with: row.key_id.clone(),
            }
            .into()),
            None => Ok(()),
        }
    }

    /// Seals `value` as secret `name`, replacing any value it had.
    pub(crate) fn set(&self, name: &str, value: &str) -> crate::Result<SecretView> {
        check_name(name)?;
        if name.starts_with(INTERNAL_PREFIX) {
            return Err(VaultError::InvalidName {
                name: name.to_owned(),
            }
            .into());
        }
        self.seal_put(name, value)
    }

    /// Whether the key is `SKIFF_VAULT_KEY`: the one every gateway of a deployment is given,
    /// so what one seals another opens.
    pub(crate) fn key_is_shared(&self) -> bool {
        self.env_key.is_some()
    }

    /// Seals `value` under one of the gateway's own names ([`INTERNAL_PREFIX`]`suffix`).
    pub(crate) fn keep_internal(&self, suffix: &str, value: &str) -> crate::Result<()> {
        let name = format!("{INTERNAL_PREFIX}{suffix}");
        check_name(&name)?;
        self.seal_put(&name, value).map(drop)
    }

    /// Whether the gateway's own secret `suffix` is sealed in the vault.
    pub(crate) fn has_internal(&self, suffix: &str) -> crate::Result<bool> {
        Ok(self
            .store
            .secret(&format!("{INTERNAL_PREFIX}{suffix}"))?
            .is_some())
    }

    /// The plaintext of the gateway's own secret `suffix`.
    pub(crate) fn open_internal(&self, suffix: &str) -> crate::Result<String> {
        self.open(&format!("{INTERNAL_PREFIX}{suffix}"))
    }

    fn seal_put(&self, name: &str, value: &str) -> crate::Result<SecretView> {
        if value.is_empty() {
            return Err(VaultError::EmptyValue {
                name: name.to_owned(),
            }
            .into());
        }
        let mut slot = self.slot();
        let keys = self
            .keyring(&mut slot, true)?
            .ok_or_else(|| Error::Internal("the vault key was not created".into()))?;
        let row = self
            .store
            .put_secret(name, &seal(&keys.current, name, value)?)?;
        Ok(view(&row))
    }

    /// The plaintext of `name`.
    pub(crate) fn open(&self, name: &str) -> crate::Result<String> {
        let not_found = || VaultError::NotFound {
            name: name.to_owned(),
        };
        // The keyring first: loading it may finish a rotation, which reseals the row.
        let keys = self.keyring(&mut self.slot(), false)?;
        let row = self.store.secret(name)?.ok_or_else(not_found)?;
        let Some(keys) = keys else {
            return Err(VaultError::NoKey {
                path: self.key_path(),
            }
            .into());
        };
        self.open_row(&keys, &row)
    }

    pub(crate) fn list(&self) -> crate::Result<Vec<SecretView>> {
        Ok(self
            .store
            .secrets()?
            .iter()
            .filter(|row| !row.name.starts_with(INTERNAL_PREFIX))
            .map(view)
            .collect())
    }

    /// Removes `name`; what it was (name and dates).
    pub(crate) fn remove(&self, name: &str) -> crate::Result<SecretView> {
        check_name(name)?;
        let not_found = || VaultError::NotFound {
            name: name.to_owned(),
        };
        let row = self.store.secret(name)?.ok_or_else(not_found)?;
        if !self.store.delete_secret(name)? {
            return Err(not_found().into());
        }
        Ok(view(&row))
    }

    /// Seals every secret under a new key (see the module's doc for the order).
    pub(crate) fn rotate(&self) -> crate::Result<RotatedKey> {
        let file = self.env_key.is_none();
        let mut slot = self.slot();
        let Some(mut old) = self.keyring(&mut slot, false)? else {
            // No key yet, so nothing is sealed: the new key is simply the first.
            self.keyring(&mut slot, true)?;
            return Ok(RotatedKey {
                resealed: 0,
                key_source: self.source_name(),
                new_key: None,
            });
        };
        if old.previous.is_some() {
            // A rotation of this process failed after its key files moved: finish it first,
            // or this one would overwrite the only copy of the key those rows need.
            self.settle(&old)?;
            old = Arc::new(Keyring {
                current: old.current.clone(),
                previous: None,
            });
            *slot = Some(old.clone());
        }
        // Everything must open before anything changes.
        for row in self.store.secrets()? {
            self.open_row(&old, &row)?;
        }
        let bytes = random::<KEY_LEN>()?;
        let both = Keyring {
            current: Key::from_bytes(&bytes, &self.source_name())?,
            previous: Some(old.current.clone()),
        };
        if file {
            let path = self.key_path();
            let text = std::fs::read(&path).map_err(|source| VaultError::KeyFile {
                action: "read",
                path: path.clone(),
                source,
            })?;
            let on_disk = Key::parse(&String::from_utf8_lossy(&text), &self.source_name())?;
            if on_disk.id != old.current.id {
                return Err(Error::Internal(format!(
                    "{} changed while the gateway was running; restart the gateway, then rotate",
                    path.display()
                )));
            }
            write_key_text(&self.dir, PREVIOUS_KEY_FILE, &text)?;
            write_key_file(&self.dir, KEY_FILE, &bytes)?;
        }
        let resealed = reseal(&*self.store, |row| {
            let plain = self.open_row(&both, row)?;
            seal(&both.current, &row.name, &plain)
        });
        let resealed = match resealed {
            Ok(n) => n,
            Err(e) => {
                // Rows still name the old key, and the files (or this memory) hold both keys,
                // so everything still opens; the next load settles it.
                *slot = Some(Arc::new(both));
                return Err(e);
            }
        };
        let new = Arc::new(Keyring {
            current: both.current,
            previous: None,
        });
        *slot = Some(new);
        if file {
            remove_key_file(&self.dir, PREVIOUS_KEY_FILE)?;
        }
        Ok(RotatedKey {
            resealed,
            key_source: self.source_name(),
            new_key: (!file).then(|| BASE64.encode(bytes)),
        })
    }
}

impl skiff_llm::Secrets for Vault {
    fn reveal(
        &self,
        name: &str,
    ) -> std::result::Result<String, Box<dyn std::error::Error + Send + Sync>> {
        // A database failure's own words stay in the log (see `Error::to_api`).
        self.open(name).map_err(|e| {
            if e.code() == skiff_protocol::api::ErrorCode::Internal {
                tracing::error!(secret = name, error = %e, "a vault secret could not be opened");
            }
            e.to_api().1.message.into()
        })
    }
}

fn view(row: &SecretRow) -> SecretView {
    SecretView {
        name: row.name.clone(),
        created_at_ms: row.created_at_ms,
        updated_at_ms: row.updated_at_ms,
    }
}

fn check_name(name: &str) -> Result<(), VaultError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(VaultError::InvalidName {
            name: name.to_owned(),
        })
    }
}

fn seal(key: &Key, name: &str, value: &str) -> crate::Result<Resealed> {
    let nonce = random::<NONCE_LEN>()?;
    let ciphertext = key
        .cipher
        .encrypt(
            Nonce::from_slice(&nonce),
            Payload {
                msg: value.as_bytes(),
                aad: name.as_bytes(),
            },
        )
        .map_err(|e| VaultError::Seal {
            name: name.to_owned(),
            problem: e.to_string(),
        })?;
    Ok(Resealed {
        ciphertext,
        nonce: nonce.to_vec(),
        key_id: key.id.clone(),
    })
}

/// The key in `path`, if the file exists; refused when group or others may read or write it.
fn read_key_file(path: &Path) -> Result<Option<Key>, VaultError> {
    let file_error = |action, source| VaultError::KeyFile {
        action,
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(file_error("read", e)),
    };
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(VaultError::KeyFileMode {
            path: path.to_path_buf(),
            mode,
        });
    }
    let text = std::fs::read_to_string(path).map_err(|e| file_error("read", e))?;
    Key::parse(&text, &path.display().to_string()).map(Some)
}

/// Writes a new key file as base64 text.
fn write_key_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), VaultError> {
    write_key_text(dir, name, format!("{}\n", BASE64.encode(bytes)).as_bytes())
}

/// Replaces `dir/name` atomically with `text` (mode 0600): a temporary file written and
/// synced, renamed over the old one, the directory synced.
fn write_key_text(dir: &Path, name: &str, text: &[u8]) -> Result<(), VaultError> {
    let path = dir.join(name);
    let tmp = dir.join(format!("{name}.tmp"));
    let fail = |action, source| VaultError::KeyFile {
        action,
        path: path.clone(),
        source,
    };
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail("replace", e)),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| fail("write", e))?;
    file.write_all(text).map_err(|e| fail("write", e))?;
    file.sync_all().map_err(|e| fail("write", e))?;
    std::fs::rename(&tmp, &path).map_err(|e| fail("replace", e))?;
    sync_dir(dir).map_err(|e| fail("write", e))
}

fn remove_key_file(dir: &Path, name: &str) -> Result<(), VaultError> {
    let path = dir.join(name);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(VaultError::KeyFile {
                action: "remove",
                path,
                source,
            });
        }
    }
    sync_dir(dir).map_err(|source| VaultError::KeyFile {
        action: "remove",
        path,
        source,
    })
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

// ---- routes ----

type Shared = State<Arc<Core>>;

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new()
        .route("/v1/secrets", get(list))
        .route("/v1/secrets/rotate-key", post(rotate))
        .route("/v1/secrets/{name}", put(set).delete(remove))
}

/// The vault is the gateway's, like its configuration: only the admin may touch it.
fn admin_only(core: &Core, scope: &Scope, action: &str, target: &str) -> crate::Result<()> {
    if crate::people::gateway_admin(core, scope) {
        return Ok(());
    }
    core.audit(scope, action, target, "denied", serde_json::json!({}));
    Err(Error::Forbidden(
        "only the gateway's admin may read or change the vault".into(),
    ))
}

async fn list(State(core): Shared, Extension(scope): Extension<Scope>) -> crate::Result<Response> {
    admin_only(&core, &scope, "secret.list", "-")?;
    Ok(Json(SecretList {
        secrets: core.vault.list()?,
    })
    .into_response())
}

async fn set(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    UrlPath(name): UrlPath<String>,
    body: Result<Json<SetSecretRequest>, axum::extract::rejection::JsonRejection>,
) -> crate::Result<Response> {
    admin_only(&core, &scope, "secret.set", &name)?;
    // The rejection's text quotes no body (serde names the field or the syntax error's place).
    let Json(req) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    let vault = core.vault.clone();
    let view = tokio::task::spawn_blocking(move || vault.set(&name, &req.value))
        .await
        .map_err(|e| Error::Internal(format!("the vault's task failed: {e}")))??;
    core.audit(
        &scope,
        "secret.set",
        &view.name,
        "applied",
        serde_json::json!({ "replaced": view.updated_at_ms != view.created_at_ms }),
    );
    Ok(Json(view).into_response())
}

async fn remove(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
    UrlPath(name): UrlPath<String>,
) -> crate::Result<Response> {
    admin_only(&core, &scope, "secret.rm", &name)?;
    let removed = core.vault.remove(&name)?;
    core.audit(&scope, "secret.rm", &name, "applied", serde_json::json!({}));
    Ok(Json(removed).into_response())
}

async fn rotate(
    State(core): Shared,
    Extension(scope): Extension<Scope>,
) -> crate::Result<Response> {
    admin_only(&core, &scope, "secret.rotate_key", "-")?;
    let vault = core.vault.clone();
    let rotated = tokio::task::spawn_blocking(move || vault.rotate())
        .await
        .map_err(|e| Error::Internal(format!("the vault's task failed: {e}")))?;
    let rotated = match rotated {
        Ok(rotated) => rotated,
        Err(e) => {
            core.audit(
                &scope,
                "secret.rotate_key",
                "-",
                "failed",
                serde_json::json!({ "code": e.code().as_str() }),
            );
            return Err(e);
        }
    };
    core.audit(
        &scope,
        "secret.rotate_key",
        "-",
        "applied",
        serde_json::json!({ "resealed": rotated.resealed, "key_source": rotated.key_source }),
    );
    Ok(Json(rotated).into_response())
}

/// The store's `reseal_secrets` with a reseal that fails with the gateway's errors: the first
/// such failure is what the caller gets (and the store has written nothing).
fn reseal(
    store: &dyn Backend,
    mut each: impl FnMut(&SecretRow) -> crate::Result<Resealed>,
) -> crate::Result<usize> {
    let mut failed = None;
    let resealed = store.reseal_secrets(&mut |row| {
        each(row).map_err(|e| {
            let detail = e.to_string();
            failed = Some(e);
            skiff_store::Error::Corrupt {
                what: "vault secret",
                detail,
            }
        })
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(resealed?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use skiff_store::Store;

    const VALUE: &str = "sk-test-0123456789abcdef";

    struct Fixture {
        dir: tempfile::TempDir,
        store: Arc<Store>,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            let store = Arc::new(Store::open(&dir.path().join("skiff.db")).unwrap());
            Fixture { dir, store }
        }

        fn vault(&self, env_key: Option<&str>) -> Vault {
            Vault::new(
                self.store.clone(),
                self.dir.path(),
                env_key.map(str::to_owned),
            )
        }

        fn key_file(&self) -> PathBuf {
            self.dir.path().join(KEY_FILE)
        }
    }

    fn env_key() -> String {
        BASE64.encode(random::<KEY_LEN>().unwrap())
    }

    #[test]
    fn a_secret_set_opens_again_and_its_key_file_is_private() {
        let f = Fixture::new();
        let vault = f.vault(None);
        vault.set("openai", VALUE).unwrap();
        assert_eq!(vault.open("openai").unwrap(), VALUE);
        let mode = std::fs::metadata(f.key_file())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // A restarted gateway reads the same key file.
        assert_eq!(f.vault(None).open("openai").unwrap(), VALUE);
        let listed = vault.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name, "openai");
        let missing = vault.open("anthropic").unwrap_err().to_string();
        assert!(missing.contains("no secret `anthropic`"), "{missing}");
        let bad = vault.set("../etc", VALUE).unwrap_err();
        assert_eq!(bad.code(), skiff_protocol::api::ErrorCode::BadRequest);
    }

    #[test]
    fn a_wrong_key_is_refused_naming_where_the_key_came_from() {
        let f = Fixture::new();
        f.vault(Some(&env_key())).set("openai", VALUE).unwrap();
        let e = f.vault(Some(&env_key())).open("openai").unwrap_err();
        let message = e.to_string();
        assert!(
            message.contains("sealed with another key") && message.contains(KEY_ENV),
            "{message}"
        );
        assert!(!message.contains(VALUE));
        let garbage = f.vault(Some("not base64!")).open("openai").unwrap_err();
        assert!(garbage.to_string().contains(KEY_ENV), "{garbage}");
    }

    #[test]
    fn a_key_file_others_may_read_is_refused() {
        let f = Fixture::new();
        f.vault(None).set("openai", VALUE).unwrap();
        std::fs::set_permissions(f.key_file(), std::fs::Permissions::from_mode(0o644)).unwrap();
        let message = f.vault(None).open("openai").unwrap_err().to_string();
        assert!(
            message.contains("mode 0644") && message.contains("chmod 600"),
            "{message}"
        );
    }

    #[test]
    fn both_a_key_file_and_the_variable_are_refused_rather_than_guessed_between() {
        let f = Fixture::new();
        f.vault(None).set("openai", VALUE).unwrap();
        let message = f
            .vault(Some(&env_key()))
            .open("openai")
            .unwrap_err()
            .to_string();
        assert!(message.contains("will not guess"), "{message}");
    }

    #[test]
    fn a_ciphertext_moved_to_another_name_does_not_open() {
        let f = Fixture::new();
        let vault = f.vault(None);
        vault.set("openai", VALUE).unwrap();
        vault.set("anthropic", "another-value").unwrap();
        let openai = f.store.secret("openai").unwrap().unwrap();
        f.store
            .put_secret(
                "anthropic",
                &Resealed {
                    ciphertext: openai.ciphertext,
                    nonce: openai.nonce,
                    key_id: openai.key_id,
                },
            )
            .unwrap();
        let message = vault.open("anthropic").unwrap_err().to_string();
        assert!(
            message.contains("altered or belong to another secret"),
            "{message}"
        );
        assert!(!message.contains(VALUE));
    }

    #[test]
    fn rotation_keeps_every_secret_and_the_old_key_opens_none() {
        let f = Fixture::new();
        let vault = f.vault(None);
        vault.set("openai", VALUE).unwrap();
        vault.set("github", "ghp-token").unwrap();
        let old = read_key_file(&f.key_file()).unwrap().unwrap();

        let rotated = vault.rotate().unwrap();
        assert_eq!(rotated.resealed, 2);
        assert_eq!(rotated.new_key, None, "a key file's key is never shown");
        assert!(!f.dir.path().join(PREVIOUS_KEY_FILE).exists());
        for vault in [&vault, &f.vault(None)] {
            assert_eq!(vault.open("openai").unwrap(), VALUE);
            assert_eq!(vault.open("github").unwrap(), "ghp-token");
        }
        let only_old = Keyring {
            current: old,
            previous: None,
        };
        for row in f.store.secrets().unwrap() {
            assert!(vault.open_row(&only_old, &row).is_err(), "{}", row.name);
            let forced = only_old.current.cipher.decrypt(
                Nonce::from_slice(&row.nonce),
                Payload {
                    msg: &row.ciphertext,
                    aad: row.name.as_bytes(),
                },
            );
            assert!(forced.is_err(), "the old key still opens {}", row.name);
        }
    }

    #[test]
    fn with_the_key_in_the_environment_rotation_hands_the_new_key_back_once() {
        let f = Fixture::new();
        let old = env_key();
        let vault = f.vault(Some(&old));
        vault.set("openai", VALUE).unwrap();
        let rotated = vault.rotate().unwrap();
        let new = rotated.new_key.unwrap();
        assert_eq!(rotated.key_source, KEY_ENV);
        assert!(
            !f.key_file().exists(),
            "no key file is written beside the variable"
        );
        assert_eq!(vault.open("openai").unwrap(), VALUE);
        assert_eq!(f.vault(Some(&new)).open("openai").unwrap(), VALUE);
        assert!(f.vault(Some(&old)).open("openai").is_err());
    }

    /// The state a crash leaves between the key files' move and the transaction's commit: the
    /// new key in `vault.key`, the old one in `vault.key.previous`, rows still under the old.
    #[test]
    fn a_rotation_cut_short_before_its_commit_still_opens_and_is_finished_at_next_use() {
        let f = Fixture::new();
        f.vault(None).set("openai", VALUE).unwrap();
        let old_text = std::fs::read(f.key_file()).unwrap();
        write_key_text(f.dir.path(), PREVIOUS_KEY_FILE, &old_text).unwrap();
        write_key_file(f.dir.path(), KEY_FILE, &random::<KEY_LEN>().unwrap()).unwrap();

        let restarted = f.vault(None);
        assert_eq!(restarted.open("openai").unwrap(), VALUE);
        assert!(!f.dir.path().join(PREVIOUS_KEY_FILE).exists());
        let current = read_key_file(&f.key_file()).unwrap().unwrap();
        assert_eq!(
            f.store.secret("openai").unwrap().unwrap().key_id,
            current.id
        );
    }
}
