//! Named host sets for `preset:NAME` rules: the public package registries of an ecosystem and
//! the hosts their clients download from, as the stock client is configured out of the box.
//! A mirror, a private registry or a tool's own installer host is not here: name it in the
//! rule list.
//!
//! Preset hosts are never "named explicitly": a preset host that resolves to a non-public
//! address is refused like one matched by a wildcard.

/// One preset: its name and the hosts (any port) it allows.
pub(crate) struct Preset {
    pub name: &'static str,
    pub hosts: &'static [&'static str],
}

pub(crate) const PRESETS: &[Preset] = &[
    // pip and uv: the simple index and JSON API on pypi.org, every wheel and sdist from
    // files.pythonhosted.org.
    Preset {
        name: "python",
        hosts: &["pypi.org", "files.pythonhosted.org"],
    },
    // npm and pnpm use registry.npmjs.org for metadata and tarballs alike; yarn (classic and
    // berry) defaults to registry.yarnpkg.com, which serves the same registry.
    Preset {
        name: "node",
        hosts: &["registry.npmjs.org", "registry.yarnpkg.com"],
    },
    // cargo's sparse index (the default since 1.70) is index.crates.io, whose config.json sends
    // downloads to static.crates.io and the web API to crates.io. rustup fetches toolchains
    // from static.rust-lang.org; its installer script is served by sh.rustup.rs. The old git
    // index (github.com) is deliberately absent: it would allow all of GitHub.
    Preset {
        name: "rust",
        hosts: &[
            "crates.io",
            "index.crates.io",
            "static.crates.io",
            "static.rust-lang.org",
            "sh.rustup.rs",
        ],
    },
    // The go command's default GOPROXY and GOSUMDB. proxy.golang.org answers many module zip
    // downloads with a 302 to a signed URL on storage.googleapis.com, so `go mod download`
    // fails without it. That host serves every public Google Cloud Storage bucket: this preset
    // is broader than the others, and says so here rather than failing at random.
    Preset {
        name: "go",
        hosts: &[
            "proxy.golang.org",
            "sum.golang.org",
            "storage.googleapis.com",
        ],
    },
    // apt's default sources: deb.debian.org (also serving /debian-security since bookworm) and
    // security.debian.org, which older images still name. apt speaks plain HTTP to them.
    Preset {
        name: "debian",
        hosts: &["deb.debian.org", "security.debian.org"],
    },
];

pub(crate) fn find(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

/// `python, node, rust, go, debian`: for error messages.
pub(crate) fn known() -> String {
    PRESETS
        .iter()
        .map(|p| format!("preset:{}", p.name))
        .collect::<Vec<_>>()
        .join(", ")
}
