//! The model catalog: provider configuration, validation, model-ref resolution and dispatch of a
//! request to its adapter.
//!
//! It owns which providers exist and what a model ref means. It deliberately does not parse
//! skiff.toml (the gateway does, so key paths appear in errors) and knows no wire format.

use crate::drive::{Failure, drive};
use crate::http::{HttpProvider, KeySource};
use crate::scripted::Script;
use crate::{CacheKey, Error, Result, Secrets, anthropic, http, openai, responses};
use futures_util::stream::BoxStream;
use serde::Deserialize;
use skiff_protocol::api::{ModelPrices, ModelView};
use skiff_protocol::model::{ModelErrorKind, ModelEvent, ModelRef, ModelRequest, ReasoningEffort};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const BUILTIN_SCRIPTED: &str = "scripted";
const DEMO_MODEL: &str = "scripted/demo";
const DEMO_SCRIPT: &str = include_str!("scripted/demo.toml");
const DEFAULT_IDLE_TIMEOUT_S: u64 = 120;
const DEFAULT_MAX_RETRIES: u32 = 2;
/// The context window assumed for a model nobody described: small enough for local servers.
const DEFAULT_CONTEXT_WINDOW: u64 = 32_768;

/// One `[providers.<name>]` table of skiff.toml.
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    pub api: Api,
    /// Required for the HTTP apis, for example `https://api.openai.com/v1`.
    #[serde(default)]
    pub base_url: Option<String>,
    /// The environment variable holding the API key; unset for local servers that need none.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Where the API key comes from: `"env:VAR"` (the gateway's environment) or `"vault:NAME"`
    /// (a secret `skiff secret set NAME` stored). Read at each call, like `api_key_env`, which
    /// is `"env:VAR"` spelled the old way; a provider has one or the other.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Required for `api = "scripted"`; a relative path resolves against the config file's
    /// directory.
    #[serde(default)]
    pub script: Option<PathBuf>,
    /// Longest silence tolerated while waiting for the provider, in seconds (default 120).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// Retries on 429/503/529 before anything streamed, waiting `retry-after` when it is at most
    /// 10 s, else 1 s when absent (default 2).
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// Prices of this provider's models, by model id (`[providers.NAME.prices."MODEL"]`), for
    /// the costs `session show` and the UI print. A model without prices has no cost shown.
    #[serde(default)]
    pub prices: BTreeMap<String, PriceConfig>,
    /// What this provider's models can do, by model id (`[providers.NAME.models."MODEL"]`).
    /// A model without a table gets the defaults [`ModelSettings::defaults_for`] knows.
    #[serde(default)]
    pub models: BTreeMap<String, ModelConfig>,
}

/// One `[providers.NAME.models."MODEL"]` table; every field overrides the model's default.
#[derive(Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model's context window in tokens; compaction keeps every request within it.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// `"off"`, `"low"`, `"medium"` or `"high"`: how hard the model thinks unless a session's
    /// `--reasoning` says otherwise.
    #[serde(default)]
    pub reasoning: Option<String>,
    /// Whether the model takes images (a `read` of a PNG, JPEG, GIF or WebP file).
    #[serde(default)]
    pub images: Option<bool>,
}

/// What a model can do, as the loop and the adapters need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSettings {
    pub context_window: u64,
    /// `None`: the model is not asked to reason (no thinking, no effort sent).
    pub reasoning: Option<ReasoningEffort>,
    pub images: bool,
}

impl ModelSettings {
    /// Defaults by model id, for models a configuration does not describe: the context window
    /// of well-known model families, images for the families that take them, no reasoning.
    pub fn defaults_for(model_id: &str) -> ModelSettings {
        let id = model_id.to_ascii_lowercase();
        let context_window = if id.starts_with("claude") {
            200_000
        } else if id.starts_with("gpt-4.1") {
            1_047_576
        } else if id.starts_with("gpt-5") || id.starts_with("o3") || id.starts_with("o4") {
            400_000
        } else if id.starts_with("gpt-4o") {
            128_000
        } else {
            DEFAULT_CONTEXT_WINDOW
        };
        let images = ["claude", "gpt-4o", "gpt-4.1", "gpt-5", "o3", "o4"]
            .iter()
            .any(|family| id.starts_with(family));
        ModelSettings {
            context_window,
            reasoning: None,
            images,
        }
    }
}

/// One `[providers.NAME.prices."MODEL"]` table, in US dollars per million tokens.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    pub input: f64,
    pub output: f64,
    /// Tokens read from the prompt cache; the input price when left out.
    #[serde(default)]
    pub cache_read: Option<f64>,
    /// Tokens written to the prompt cache; the input price when left out.
    #[serde(default)]
    pub cache_write: Option<f64>,
}

#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    OpenaiCompletions,
    OpenaiResponses,
    AnthropicMessages,
    Scripted,
}

impl Api {
    fn as_str(self) -> &'static str {
        match self {
            Api::OpenaiCompletions => "openai-completions",
            Api::OpenaiResponses => "openai-responses",
            Api::AnthropicMessages => "anthropic-messages",
            Api::Scripted => "scripted",
        }
    }
}

/// The configured providers. Cheap to clone; shared by every session. Holds no API key (keys
/// are read from the environment or the vault per call), so `Debug` is safe to log.
#[derive(Clone, Debug)]
pub struct Catalog {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    providers: BTreeMap<String, Provider>,
    /// By model ref (`provider/model-id`).
    prices: BTreeMap<String, ModelPrices>,
    /// By model ref, for the models skiff.toml describes.
    settings: BTreeMap<String, ModelSettings>,
    default_model: ModelRef,
    client: reqwest::Client,
}

#[derive(Debug)]
enum Provider {
    OpenAi(HttpProvider),
    OpenAiResponses(HttpProvider),
    Anthropic(HttpProvider),
    Scripted { script: Script, builtin: bool },
}

impl Catalog {
    /// Validates every provider: `base_url` present and a valid http(s) URL for the HTTP apis,
    /// the script file readable and well-formed for `scripted`. Unless the configuration names
    /// a provider `scripted` itself, a built-in one with the single model `scripted/demo` exists.
    /// `secrets` opens `api_key = "vault:NAME"` keys; without it such a provider's calls fail
    /// saying the vault is not available.
    pub fn new(
        providers: BTreeMap<String, ProviderConfig>,
        default_model: Option<String>,
        config_dir: &Path,
        secrets: Option<Arc<dyn Secrets>>,
    ) -> Result<Catalog> {
        let mut built = BTreeMap::new();
        let mut prices = BTreeMap::new();
        let mut settings = BTreeMap::new();
        for (name, mut config) in providers {
            for (model, price) in std::mem::take(&mut config.prices) {
                let model_ref = format!("{name}/{model}");
                prices.insert(model_ref, validated_prices(&name, &model, price)?);
            }
            for (model, described) in std::mem::take(&mut config.models) {
                let model_ref = format!("{name}/{model}");
                settings.insert(model_ref, validated_settings(&name, &model, described)?);
            }
            let provider = Provider::from_config(&name, config, config_dir, secrets.as_ref())?;
            built.insert(name, provider);
        }
        if !built.contains_key(BUILTIN_SCRIPTED) {
            let script = Script::parse(DEMO_SCRIPT).map_err(|problem| Error::InvalidScript {
                provider: BUILTIN_SCRIPTED.to_owned(),
                path: PathBuf::from("<built-in demo script>"),
                problem,
            })?;
            built.insert(
                BUILTIN_SCRIPTED.to_owned(),
                Provider::Scripted {
                    script,
                    builtin: true,
                },
            );
        }
        // Without a configured default, `scripted/demo` always resolves: a provider named
        // `scripted` exists, built-in or the user's own.
        let (default_model, _) = lookup(&built, default_model.as_deref().unwrap_or(DEMO_MODEL))
            .map_err(|e| Error::InvalidDefaultModel(Box::new(e)))?;
        let client = reqwest::Client::builder()
            .build()
            .map_err(Error::HttpClient)?;
        Ok(Catalog {
            inner: Arc::new(Inner {
                providers: built,
                prices,
                settings,
                default_model,
                client,
            }),
        })
    }

    /// `None` gives the configured default model, else `scripted/demo`.
    pub fn resolve(&self, model: Option<&str>) -> Result<ModelRef> {
        match model {
            None => Ok(self.inner.default_model.clone()),
            Some(model) => lookup(&self.inner.providers, model).map(|(model_ref, _)| model_ref),
        }
    }

    /// How to show `model` to a person; a scripted model is always labelled as such.
    pub fn describe(&self, model: &ModelRef) -> ModelView {
        let scripted = matches!(
            self.inner.providers.get(model.provider()),
            Some(Provider::Scripted { .. })
        );
        ModelView {
            model_ref: model.to_string(),
            scripted,
            label: if scripted {
                format!("{model} (scripted)")
            } else {
                model.to_string()
            },
            prices: self.prices(model),
        }
    }

    /// What `model` can do: its `[providers.NAME.models."MODEL"]` table over the defaults.
    pub fn settings(&self, model: &ModelRef) -> ModelSettings {
        self.inner.settings(model)
    }

    /// `model`'s configured prices, if any.
    pub fn prices(&self, model: &ModelRef) -> Option<ModelPrices> {
        self.inner.prices.get(model.as_str()).copied()
    }

    /// Streams the model's answer to `request`. Never panics; the stream always ends with
    /// exactly one `Done` or `Error` and nothing after it. When `cancel` fires, the request in
    /// flight is dropped and the stream ends promptly with `Done { stop_reason: Cancelled }`.
    ///
    /// `cache_key` names the conversation for providers whose prompt cache is keyed (see
    /// [`CacheKey`]); the gateway passes its session's key in every placement.
    pub fn stream(
        &self,
        request: ModelRequest,
        cache_key: Option<CacheKey>,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        let inner = Arc::clone(&self.inner);
        drive(cancel, move |emitter| async move {
            // Looked up again because a stored ref may predate a configuration change.
            let (_, provider) = lookup(&inner.providers, request.model.as_str())
                .map_err(|e| Failure::new(ModelErrorKind::Configuration, e.to_string()))?;
            let cache_key = cache_key.as_ref();
            let client = &inner.client;
            let settings = &inner.settings_for(&request);
            match provider {
                Provider::OpenAi(provider) => {
                    let decoder = http::run::<openai::Decoder>;
                    decoder(client, provider, &request, settings, cache_key, &emitter).await
                }
                Provider::OpenAiResponses(provider) => {
                    let decoder = http::run::<responses::Decoder>;
                    decoder(client, provider, &request, settings, cache_key, &emitter).await
                }
                Provider::Anthropic(provider) => {
                    let decoder = http::run::<anthropic::Decoder>;
                    decoder(client, provider, &request, settings, cache_key, &emitter).await
                }
                Provider::Scripted { script, .. } => Ok(script.play(&request, &emitter).await),
            }
        })
    }
}

impl Inner {
    fn settings(&self, model: &ModelRef) -> ModelSettings {
        self.settings
            .get(model.as_str())
            .copied()
            .unwrap_or_else(|| ModelSettings::defaults_for(model.model_id()))
    }

    /// The model's settings with the session's `--reasoning` choice over its own.
    fn settings_for(&self, request: &ModelRequest) -> ModelSettings {
        let mut settings = self.settings(&request.model);
        if let Some(effort) = request.reasoning {
            settings.reasoning = (effort != ReasoningEffort::Off).then_some(effort);
        }
        settings
    }
}

impl Provider {
    fn from_config(
        name: &str,
        config: ProviderConfig,
        config_dir: &Path,
        secrets: Option<&Arc<dyn Secrets>>,
    ) -> Result<Provider> {
        if name.contains('/') || ModelRef::parse(&format!("{name}/m")).is_none() {
            return Err(invalid(
                name,
                "a provider name must be non-empty, without `/` or whitespace, because models are named `provider/model`".to_owned(),
            ));
        }
        match config.api {
            Api::Scripted => scripted_provider(name, config, config_dir),
            Api::OpenaiCompletions => {
                http_provider(name, config, "https://api.openai.com/v1", secrets)
                    .map(Provider::OpenAi)
            }
            Api::OpenaiResponses => {
                http_provider(name, config, "https://api.openai.com/v1", secrets)
                    .map(Provider::OpenAiResponses)
            }
            Api::AnthropicMessages => {
                http_provider(name, config, "https://api.anthropic.com", secrets)
                    .map(Provider::Anthropic)
            }
        }
    }
}

fn scripted_provider(name: &str, config: ProviderConfig, config_dir: &Path) -> Result<Provider> {
    if config.base_url.is_some() {
        return Err(unused(name, config.api, "base_url"));
    }
    if config.api_key_env.is_some() {
        return Err(unused(name, config.api, "api_key_env"));
    }
    if config.api_key.is_some() {
        return Err(unused(name, config.api, "api_key"));
    }
    let Some(script) = config.script else {
        return Err(invalid(
            name,
            "api = \"scripted\" needs `script`, the path of a script file".to_owned(),
        ));
    };
    let path = config_dir.join(script);
    let script = std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|text| Script::parse(&text))
        .map_err(|problem| Error::InvalidScript {
            provider: name.to_owned(),
            path,
            problem,
        })?;
    Ok(Provider::Scripted {
        script,
        builtin: false,
    })
}

fn http_provider(
    name: &str,
    config: ProviderConfig,
    example_url: &str,
    secrets: Option<&Arc<dyn Secrets>>,
) -> Result<HttpProvider> {
    if config.script.is_some() {
        return Err(unused(name, config.api, "script"));
    }
    let Some(base_url) = config.base_url else {
        return Err(invalid(
            name,
            format!(
                "api = \"{}\" needs `base_url`, for example \"{example_url}\"",
                config.api.as_str()
            ),
        ));
    };
    match reqwest::Url::parse(&base_url) {
        Ok(url) if matches!(url.scheme(), "http" | "https") => {}
        Ok(_) => {
            let problem = format!("base_url `{base_url}` must start with http:// or https://");
            return Err(invalid(name, problem));
        }
        Err(e) => {
            let problem = format!("base_url `{base_url}` is not a valid URL: {e}");
            return Err(invalid(name, problem));
        }
    }
    let idle_timeout_s = config.idle_timeout_s.unwrap_or(DEFAULT_IDLE_TIMEOUT_S);
    if idle_timeout_s == 0 {
        return Err(invalid(
            name,
            "idle_timeout_s must be at least 1".to_owned(),
        ));
    }
    let key = match (config.api_key_env, config.api_key) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                name,
                "set `api_key` or `api_key_env`, not both (`api_key_env = \"VAR\"` is `api_key = \"env:VAR\"`)".to_owned(),
            ));
        }
        (Some(var), None) => Some(KeySource::Env { var }),
        (None, Some(text)) => Some(key_source(name, &text)?),
        (None, None) => None,
    };
    Ok(HttpProvider {
        name: name.to_owned(),
        base_url: base_url.trim_end_matches('/').to_owned(),
        key,
        secrets: secrets.cloned(),
        idle_timeout: Duration::from_secs(idle_timeout_s),
        max_retries: config.max_retries.unwrap_or(DEFAULT_MAX_RETRIES),
    })
}

/// `api_key = "env:VAR"` or `"vault:NAME"`; the value itself never appears in configuration.
fn key_source(provider: &str, text: &str) -> Result<KeySource> {
    let named = |rest: &str| {
        !rest.is_empty()
            && rest
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    };
    match text.split_once(':') {
        Some(("env", var)) if named(var) => Ok(KeySource::Env {
            var: var.to_owned(),
        }),
        Some(("vault", secret)) if named(secret) => Ok(KeySource::Vault {
            secret: secret.to_owned(),
        }),
        _ => Err(invalid(
            provider,
            "`api_key` must be \"env:VAR\" (the gateway's environment) or \"vault:NAME\" (a secret stored with `skiff secret set NAME`), never the key itself".to_owned(),
        )),
    }
}

/// Prices must be finite and not negative, and name a model id that can be part of a model ref.
fn validated_prices(provider: &str, model: &str, price: PriceConfig) -> Result<ModelPrices> {
    let key = |field: &str| format!("providers.{provider}.prices.\"{model}\"{field}");
    if ModelRef::parse(&format!("{provider}/{model}")).is_none() {
        return Err(Error::InvalidPrice {
            key: key(""),
            problem: "a model id must be non-empty and without whitespace".to_owned(),
        });
    }
    let fields = [
        ("input", Some(price.input)),
        ("output", Some(price.output)),
        ("cache_read", price.cache_read),
        ("cache_write", price.cache_write),
    ];
    for (field, value) in fields {
        if let Some(value) = value
            && !(value.is_finite() && value >= 0.0)
        {
            return Err(Error::InvalidPrice {
                key: key(&format!(".{field}")),
                problem: format!(
                    "{value} is not a price; give US dollars per million tokens, 0 or more (for example 3.0)"
                ),
            });
        }
    }
    Ok(ModelPrices {
        input: price.input,
        output: price.output,
        cache_read: price.cache_read.unwrap_or(price.input),
        cache_write: price.cache_write.unwrap_or(price.input),
    })
}

/// A model table's values over the model's defaults; a bad value names its key.
fn validated_settings(provider: &str, model: &str, config: ModelConfig) -> Result<ModelSettings> {
    let key = |field: &str| format!("providers.{provider}.models.\"{model}\"{field}");
    if ModelRef::parse(&format!("{provider}/{model}")).is_none() {
        return Err(Error::InvalidModelSetting {
            key: key(""),
            problem: "a model id must be non-empty and without whitespace".to_owned(),
        });
    }
    let mut settings = ModelSettings::defaults_for(model);
    if let Some(window) = config.context_window {
        if window < 1024 {
            return Err(Error::InvalidModelSetting {
                key: key(".context_window"),
                problem: format!(
                    "{window} tokens is too small a context window; give at least 1024"
                ),
            });
        }
        settings.context_window = window;
    }
    if let Some(reasoning) = config.reasoning {
        let effort = ReasoningEffort::parse(&reasoning).ok_or_else(|| Error::InvalidModelSetting {
            key: key(".reasoning"),
            problem: format!("`{reasoning}` is not a reasoning setting; use \"off\", \"low\", \"medium\" or \"high\""),
        })?;
        settings.reasoning = (effort != ReasoningEffort::Off).then_some(effort);
    }
    if let Some(images) = config.images {
        settings.images = images;
    }
    Ok(settings)
}

fn invalid(provider: &str, problem: String) -> Error {
    Error::InvalidProvider {
        provider: provider.to_owned(),
        problem,
    }
}

fn unused(provider: &str, api: Api, field: &str) -> Error {
    let problem = format!(
        "`{field}` has no meaning for api = \"{}\"; remove it",
        api.as_str()
    );
    invalid(provider, problem)
}

/// For error messages; never empty, since a `scripted` provider always exists.
fn configured(providers: &BTreeMap<String, Provider>) -> String {
    let names: Vec<&str> = providers.keys().map(String::as_str).collect();
    names.join(", ")
}

/// Resolves `model` to its ref and provider; the one place that decides what a ref means.
fn lookup<'a>(
    providers: &'a BTreeMap<String, Provider>,
    model: &str,
) -> Result<(ModelRef, &'a Provider)> {
    let model_ref = ModelRef::parse(model).ok_or_else(|| Error::MalformedModelRef {
        model: model.to_owned(),
        configured: configured(providers),
    })?;
    match providers.get(model_ref.provider()) {
        None => Err(Error::UnknownProvider {
            model: model.to_owned(),
            provider: model_ref.provider().to_owned(),
            configured: configured(providers),
        }),
        Some(Provider::Scripted { builtin: true, .. }) if model != DEMO_MODEL => {
            Err(Error::UnknownScriptedModel {
                model: model.to_owned(),
            })
        }
        Some(provider) => Ok((model_ref, provider)),
    }
}
