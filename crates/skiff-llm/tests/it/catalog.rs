//! Catalog validation, model-ref resolution and labelling.

use crate::{catalog, catalog_in, error, request, run};
use skiff_llm::{Catalog, ProviderConfig};
use skiff_protocol::api::ModelView;
use skiff_protocol::model::{ModelErrorKind, ModelRef};
use std::collections::BTreeMap;
use std::path::Path;

const PROVIDERS: &str = r#"
[openai]
api = "openai-completions"
base_url = "https://api.openai.com/v1"
api_key_env = "OPENAI_API_KEY"

[anthropic]
api = "anthropic-messages"
base_url = "https://api.anthropic.com"
"#;

fn new_catalog(providers_toml: &str, default: Option<&str>) -> Result<Catalog, String> {
    let providers: BTreeMap<String, ProviderConfig> = toml::from_str(providers_toml).unwrap();
    Catalog::new(
        providers,
        default.map(str::to_owned),
        Path::new("/etc/skiff"),
        None,
    )
    .map_err(|e| e.to_string())
}

fn resolve_error(model: &str) -> String {
    catalog(PROVIDERS)
        .resolve(Some(model))
        .unwrap_err()
        .to_string()
}

#[test]
fn default_is_the_demo_unless_configured() {
    assert_eq!(
        catalog(PROVIDERS).resolve(None).unwrap().as_str(),
        "scripted/demo"
    );
    let catalog = new_catalog(PROVIDERS, Some("openai/gpt-4o")).unwrap();
    assert_eq!(catalog.resolve(None).unwrap().as_str(), "openai/gpt-4o");
    assert_eq!(
        catalog
            .resolve(Some("anthropic/claude-sonnet-4-5"))
            .unwrap()
            .as_str(),
        "anthropic/claude-sonnet-4-5"
    );
}

#[test]
fn an_invalid_default_is_reported_at_startup() {
    let err = new_catalog(PROVIDERS, Some("gemini/pro")).unwrap_err();
    assert!(
        err.starts_with("default_model: model `gemini/pro` names the unknown provider `gemini`"),
        "{err}"
    );
}

#[test]
fn unknown_provider_lists_the_configured_ones() {
    assert_eq!(
        resolve_error("gemini/pro"),
        "model `gemini/pro` names the unknown provider `gemini`; configured providers: anthropic, openai, scripted. Add a `[providers.gemini]` table to skiff.toml or use one of those"
    );
}

#[test]
fn a_ref_without_provider_is_rejected() {
    assert_eq!(
        resolve_error("gpt-4o"),
        "model `gpt-4o` is not of the form `provider/model` (for example `scripted/demo`); configured providers: anthropic, openai, scripted"
    );
}

#[test]
fn the_built_in_scripted_provider_has_only_the_demo() {
    let err = resolve_error("scripted/other");
    assert!(err.starts_with("model `scripted/other` does not exist: the built-in `scripted` provider only has `scripted/demo`"), "{err}");
}

#[test]
fn a_configured_scripted_provider_replaces_the_built_in_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("s.toml"), "[[turns]]\ntext = \"hi\"\n").unwrap();
    let catalog = catalog_in(
        "[scripted]\napi = \"scripted\"\nscript = \"s.toml\"\n",
        dir.path(),
    );
    assert_eq!(
        catalog.resolve(Some("scripted/anything")).unwrap().as_str(),
        "scripted/anything"
    );
}

#[test]
fn scripted_models_are_labelled() {
    let catalog = catalog(PROVIDERS);
    let demo = catalog.resolve(None).unwrap();
    assert_eq!(
        catalog.describe(&demo),
        ModelView {
            model_ref: "scripted/demo".into(),
            scripted: true,
            label: "scripted/demo (scripted)".into(),
            prices: None,
        }
    );
    let real = ModelRef::parse("openai/gpt-4o").unwrap();
    assert_eq!(
        catalog.describe(&real),
        ModelView {
            model_ref: "openai/gpt-4o".into(),
            scripted: false,
            label: "openai/gpt-4o".into(),
            prices: None,
        }
    );
}

#[test]
fn openai_responses_is_configured_like_the_other_http_apis() {
    let catalog = new_catalog(
        "[openai]\napi = \"openai-responses\"\nbase_url = \"https://api.openai.com/v1\"\napi_key = \"env:OPENAI_API_KEY\"\n\n[openai.models.\"gpt-5\"]\nreasoning = \"medium\"\n",
        Some("openai/gpt-5"),
    )
    .unwrap();
    let model = catalog.resolve(None).unwrap();
    assert_eq!(model.as_str(), "openai/gpt-5");
    assert_eq!(
        catalog.settings(&model).reasoning,
        Some(skiff_protocol::model::ReasoningEffort::Medium)
    );
    assert!(!catalog.describe(&model).scripted);
    assert_eq!(
        new_catalog("[openai]\napi = \"openai-responses\"\n", None).unwrap_err(),
        "provider `openai`: api = \"openai-responses\" needs `base_url`, for example \"https://api.openai.com/v1\""
    );
    assert_eq!(
        new_catalog(
            "[openai]\napi = \"openai-responses\"\nbase_url = \"https://api.openai.com/v1\"\nscript = \"x.toml\"\n",
            None
        )
        .unwrap_err(),
        "provider `openai`: `script` has no meaning for api = \"openai-responses\"; remove it"
    );
}

#[test]
fn http_providers_need_a_valid_base_url() {
    assert_eq!(
        new_catalog("[local]\napi = \"openai-completions\"\n", None).unwrap_err(),
        "provider `local`: api = \"openai-completions\" needs `base_url`, for example \"https://api.openai.com/v1\""
    );
    let err = new_catalog(
        "[local]\napi = \"openai-completions\"\nbase_url = \"localhost:8080\"\n",
        None,
    )
    .unwrap_err();
    assert!(
        err.starts_with("provider `local`: base_url `localhost:8080`"),
        "{err}"
    );
    let err = new_catalog(
        "[a]\napi = \"anthropic-messages\"\nbase_url = \"not a url\"\n",
        None,
    )
    .unwrap_err();
    assert!(
        err.starts_with("provider `a`: base_url `not a url` is not a valid URL"),
        "{err}"
    );
}

#[test]
fn fields_of_another_api_are_rejected() {
    let err = new_catalog(
        "[fake]\napi = \"scripted\"\nscript = \"x.toml\"\nbase_url = \"http://x\"\n",
        None,
    )
    .unwrap_err();
    assert_eq!(
        err,
        "provider `fake`: `base_url` has no meaning for api = \"scripted\"; remove it"
    );
}

#[test]
fn unknown_config_keys_are_rejected() {
    let err = toml::from_str::<BTreeMap<String, ProviderConfig>>(
        "[x]\napi = \"scripted\"\nscritp = \"a\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("scritp"), "{err}");
}

#[test]
fn a_missing_script_file_is_named() {
    let err = new_catalog(
        "[fake]\napi = \"scripted\"\nscript = \"missing.toml\"\n",
        None,
    )
    .unwrap_err();
    assert!(
        err.starts_with("provider `fake`: script /etc/skiff/missing.toml: "),
        "{err}"
    );
}

#[test]
fn an_invalid_script_file_is_named_with_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[[turns]]\ntext = 3\n").unwrap();
    let providers = format!(
        "[fake]\napi = \"scripted\"\nscript = \"{}\"\n",
        path.display()
    );
    let providers: BTreeMap<String, ProviderConfig> = toml::from_str(&providers).unwrap();
    let err = Catalog::new(providers, None, Path::new("/elsewhere"), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!("provider `fake`: script {}: ", path.display())),
        "{err}"
    );
    assert!(err.contains("text"), "{err}");
}

#[tokio::test]
async fn streaming_an_unknown_model_is_a_configuration_error() {
    let events = run(&catalog(PROVIDERS), request("gemini/pro")).await;
    let (kind, message) = error(&events);
    assert_eq!(kind, ModelErrorKind::Configuration);
    assert!(message.contains("unknown provider `gemini`"), "{message}");
}

#[test]
fn the_catalog_is_shared_across_tasks() {
    fn shareable<T: Clone + Send + Sync + 'static>() {}
    shareable::<Catalog>();
}

#[test]
fn prices_are_per_model_with_cache_prices_defaulting_to_input() {
    let catalog = catalog(&format!(
        "{PROVIDERS}\n[anthropic.prices.\"claude-sonnet-4-5\"]\ninput = 3.0\noutput = 15.0\ncache_read = 0.3\n"
    ));
    let priced = ModelRef::parse("anthropic/claude-sonnet-4-5").unwrap();
    let prices = catalog.prices(&priced).unwrap();
    assert_eq!((prices.cache_read, prices.cache_write), (0.3, 3.0));
    assert_eq!(catalog.describe(&priced).prices, Some(prices));
    let unpriced = ModelRef::parse("anthropic/claude-haiku-4-5").unwrap();
    assert_eq!(catalog.prices(&unpriced), None);
    // 1000 uncached at $3, 9000 read at $0.30, 500 out at $15 (per million).
    let usage = skiff_protocol::model::Usage {
        input_tokens: 10_000,
        output_tokens: 500,
        cache_read_tokens: 9000,
        cache_write_tokens: 0,
    };
    assert!((prices.cost_usd(&usage) - 0.0132).abs() < 1e-12);
}

#[test]
fn a_bad_price_names_its_key() {
    let err = new_catalog(
        &format!("{PROVIDERS}\n[openai.prices.\"gpt-4o\"]\ninput = 2.5\noutput = -10.0\n"),
        None,
    )
    .unwrap_err();
    assert_eq!(
        err,
        "providers.openai.prices.\"gpt-4o\".output: -10 is not a price; give US dollars per million tokens, 0 or more (for example 3.0)"
    );
}
