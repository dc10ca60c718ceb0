//! An issuer's public keys (a JSON Web Key Set, from a file or a URL) and the one check every
//! signed assertion goes through: [`Jwks::verify`] (signature by one of those keys, RS256 or
//! ES256 only, issuer, audience, expiry).
//!
//! Keys rotate: a token naming a key the set lacks makes the set be read again, at most once a
//! minute, so a flood of made-up key ids cannot turn into a flood of fetches.

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How long a token may be past its expiry (or before its `nbf`) for clock skew between the
/// issuer and the gateway.
const LEEWAY_S: u64 = 30;
/// The least time between two reads of the key set prompted by an unknown key.
const REFRESH_EVERY: Duration = Duration::from_secs(60);

/// Where the keys come from.
#[derive(Clone, Debug)]
pub(crate) enum Source {
    File(PathBuf),
    Url(String),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Url(url) => f.write_str(url),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum JwksError {
    #[error("cannot read the JWKS file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot fetch the JWKS from {url}: {message}")]
    Fetch { url: String, message: String },
    #[error("{origin} is not a JWK Set (`{{\"keys\": [...]}}`): {message}")]
    Parse { origin: String, message: String },
    #[error(
        "{origin} has no RS256 or ES256 signing key (an RSA key, or an EC key on P-256); Skiff accepts no other"
    )]
    NoUsableKey { origin: String },
}

/// Why a presented token was refused. Said to the caller and written to the audit, so it names
/// the check that failed and never the token.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("it is not a signed JWT")]
    Malformed,
    #[error("it is signed with {0}; only RS256 and ES256 are accepted")]
    Algorithm(String),
    #[error("its signing key {0} is not one of the issuer's keys")]
    UnknownKey(String),
    #[error("its signature does not verify with the issuer's key")]
    Signature,
    #[error("it has expired")]
    Expired,
    #[error("it is not valid yet (its nbf is in the future)")]
    NotYetValid,
    #[error("it was not issued by the configured issuer")]
    Issuer,
    #[error("it is not meant for this gateway (its audience is not the configured one)")]
    Audience,
    #[error("it lacks the `{0}` claim")]
    MissingClaim(String),
    #[error("it cannot be checked: {0}")]
    Invalid(String),
}

/// The key set, read at start and again when a token names a key it lacks.
pub(crate) struct Jwks {
    source: Source,
    http: reqwest::Client,
    loaded: tokio::sync::RwLock<Loaded>,
}

struct Loaded {
    keys: Vec<Jwk>,
    at: Instant,
}

impl Jwks {
    /// Reads the set once; a set that cannot be read, or has no key Skiff can use, is an error
    /// (the gateway does not start with a check that would refuse everyone).
    pub(crate) async fn load(source: Source) -> Result<Jwks, JwksError> {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::limited(3))
            .timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| JwksError::Fetch {
                url: source.to_string(),
                message: e.to_string(),
            })?;
        let keys = read(&http, &source).await?;
        Ok(Jwks {
            source,
            http,
            loaded: tokio::sync::RwLock::new(Loaded {
                keys,
                at: Instant::now(),
            }),
        })
    }

    /// The claims of `token` if it is signed by one of the set's keys with RS256 or ES256,
    /// issued by `issuer` for `audience`, and unexpired.
    pub(crate) async fn verify(
        &self,
        token: &str,
        issuer: &str,
        audience: &str,
    ) -> Result<Map<String, Value>, Refusal> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| Refusal::Malformed)?;
        if !matches!(header.alg, Algorithm::RS256 | Algorithm::ES256) {
            return Err(Refusal::Algorithm(format!("{:?}", header.alg)));
        }
        let kid = header.kid.as_deref();
        let key = match self.find(header.alg, kid).await {
            Some(key) => key,
            None => {
                self.refresh().await;
                self.find(header.alg, kid).await.ok_or_else(|| {
                    Refusal::UnknownKey(kid.map_or_else(|| "(no kid)".to_owned(), str::to_owned))
                })?
            }
        };
        let key = DecodingKey::from_jwk(&key).map_err(|e| Refusal::Invalid(e.to_string()))?;
        let mut validation = Validation::new(header.alg);
        validation.leeway = LEEWAY_S;
        validation.validate_nbf = true;
        validation.set_issuer(&[issuer]);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        jsonwebtoken::decode::<Map<String, Value>>(token, &key, &validation)
            .map(|data| data.claims)
            .map_err(|e| match e.into_kind() {
                ErrorKind::InvalidSignature => Refusal::Signature,
                ErrorKind::ExpiredSignature => Refusal::Expired,
                ErrorKind::ImmatureSignature => Refusal::NotYetValid,
                ErrorKind::InvalidIssuer => Refusal::Issuer,
                ErrorKind::InvalidAudience => Refusal::Audience,
                ErrorKind::MissingRequiredClaim(claim) => Refusal::MissingClaim(claim),
                ErrorKind::InvalidToken | ErrorKind::Base64(_) | ErrorKind::Json(_) => {
                    Refusal::Malformed
                }
                other => Refusal::Invalid(format!("{other:?}")),
            })
    }

    /// The key `alg` and `kid` name: with a `kid`, the key of that id; without one, the set's
    /// only key of the algorithm's kind.
    async fn find(&self, alg: Algorithm, kid: Option<&str>) -> Option<Jwk> {
        let loaded = self.loaded.read().await;
        let mut fitting = loaded.keys.iter().filter(|k| signs_with(k, alg));
        match kid {
            Some(kid) => fitting
                .find(|k| k.common.key_id.as_deref() == Some(kid))
                .cloned(),
            None => {
                let first = fitting.next()?;
                fitting.next().is_none().then(|| first.clone())
            }
        }
    }

    /// Reads the set again unless it was read within [`REFRESH_EVERY`]; a failed read keeps
    /// the keys there were (and is logged: the refusal that follows names the unknown key).
    async fn refresh(&self) {
        let mut loaded = self.loaded.write().await;
        if loaded.at.elapsed() < REFRESH_EVERY {
            return;
        }
        loaded.at = Instant::now();
        match read(&self.http, &self.source).await {
            Ok(keys) => loaded.keys = keys,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the key set again; keeping the keys there were")
            }
        }
    }
}

/// Whether `key` can check a signature made with `alg` (and is not marked for encryption or
/// for another algorithm).
fn signs_with(key: &Jwk, alg: Algorithm) -> bool {
    if matches!(key.common.public_key_use, Some(PublicKeyUse::Encryption)) {
        return false;
    }
    let stated = key.common.key_algorithm;
    match alg {
        Algorithm::RS256 => {
            matches!(key.algorithm, AlgorithmParameters::RSA(_))
                && stated.is_none_or(|a| a == KeyAlgorithm::RS256)
        }
        Algorithm::ES256 => {
            matches!(&key.algorithm, AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256)
                && stated.is_none_or(|a| a == KeyAlgorithm::ES256)
        }
        _ => false,
    }
}

/// The keys of the set Skiff can use; keys of kinds it does not know are skipped, not fatal (a
/// provider may publish encryption or Ed25519 keys beside its signing keys).
async fn read(http: &reqwest::Client, source: &Source) -> Result<Vec<Jwk>, JwksError> {
    let body = match source {
        Source::File(path) => std::fs::read(path).map_err(|source| JwksError::Read {
            path: path.display().to_string(),
            source,
        })?,
        Source::Url(url) => fetch(http, url).await?,
    };
    parse(&body, &source.to_string())
}

async fn fetch(http: &reqwest::Client, url: &str) -> Result<Vec<u8>, JwksError> {
    let failed = |message: String| JwksError::Fetch {
        url: url.to_owned(),
        message,
    };
    let resp = http
        .get(url)
        .send()
        .await
        .map_err(|e| failed(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(failed(format!("the server answered {}", resp.status())));
    }
    Ok(resp
        .bytes()
        .await
        .map_err(|e| failed(e.to_string()))?
        .to_vec())
}

fn parse(body: &[u8], origin: &str) -> Result<Vec<Jwk>, JwksError> {
    #[derive(serde::Deserialize)]
    struct Set {
        keys: Vec<Value>,
    }
    let set: Set = serde_json::from_slice(body).map_err(|e| JwksError::Parse {
        origin: origin.to_owned(),
        message: e.to_string(),
    })?;
    let keys: Vec<Jwk> = set
        .keys
        .into_iter()
        .filter_map(|k| serde_json::from_value::<Jwk>(k).ok())
        .filter(|k| signs_with(k, Algorithm::RS256) || signs_with(k, Algorithm::ES256))
        .collect();
    if keys.is_empty() {
        return Err(JwksError::NoUsableKey {
            origin: origin.to_owned(),
        });
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_without_a_signing_key_is_refused_naming_why() {
        let err = parse(
            br#"{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}"#,
            "keys.json",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("keys.json has no RS256 or ES256"), "{err}");
        let err = parse(b"[]", "keys.json").unwrap_err().to_string();
        assert!(err.contains("keys.json is not a JWK Set"), "{err}");
    }

    #[test]
    fn keys_of_unknown_kinds_are_skipped() {
        let body = br#"{"keys": [
            {"kty": "OKP", "crv": "X448", "x": "AAAA"},
            {"kty": "EC", "crv": "P-256", "kid": "a", "use": "enc",
             "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU", "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"},
            {"kty": "EC", "crv": "P-256", "kid": "b",
             "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU", "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}
        ]}"#;
        let keys = parse(body, "keys.json").unwrap();
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].common.key_id.as_deref(), Some("b"));
    }
}
