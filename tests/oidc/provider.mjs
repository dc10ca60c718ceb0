// A real OpenID provider (node-oidc-provider, OpenID-certified) for Skiff's tests, on loopback.
//
//   node provider.mjs CONFIG.json
//
// CONFIG: { "clients": [ { "client_id", "client_secret", "email", "alg" } ], "apps": [...],
// "accounts": [...], "device_code_ttl": SECONDS, "device_interval": SECONDS }.
//
// Each of `clients` may use the client-credentials grant for a resource (`resource=<absolute
// URI>`): the access token it gets is a JWT signed by this provider's key for `alg` (RS256 or
// ES256), with the resource as its audience and the client's `email` (a string, or a list to
// test a multi-valued claim) as a claim — what an identity-aware proxy's assertion looks like.
//
// Each of `apps` ({ "client_id", "client_secret" }) is a relying party like a Skiff gateway: the
// authorization-code grant (PKCE) and the device-code grant (RFC 8628), scopes `openid email
// profile`, redirect URI `http://127.0.0.1/auth/callback` on any port (a native client's
// loopback rule, so a gateway on a port picked at start fits). Its ID tokens carry the
// account's `email`, `email_verified` and `groups`.
//
// `accounts` ({ "id", "email", "email_verified"?, "groups"? }) are the people who can sign in.
// The sign-in page is a minimal one of this file's (the provider's dev pages are off):
// `GET /interaction/UID?account=ID` signs account ID in, `?deny=1` refuses the request (the
// provider answers `access_denied`), and without either it lists the accounts as links. Consent
// is granted at once (a first-party app). A device code is confirmed at `/device` as the
// provider's own pages have it.
//
// Keys are made fresh at each start, so two providers never share a signer. Prints one JSON
// line, {"issuer": URL}, once it listens; stops when its standard input closes (the test that
// started it is gone).

import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { generateKeyPairSync, randomUUID } from 'node:crypto';
import Provider from 'oidc-provider';

const config = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const clients = new Map(config.clients.map((c) => [c.client_id, c]));
const accounts = new Map((config.accounts ?? []).map((a) => [a.id, a]));

function signingKey(alg) {
  const { privateKey } =
    alg === 'ES256'
      ? generateKeyPairSync('ec', { namedCurve: 'P-256' })
      : generateKeyPairSync('rsa', { modulusLength: 2048 });
  return { ...privateKey.export({ format: 'jwk' }), alg, use: 'sig', kid: randomUUID() };
}

const server = createServer();
server.listen(0, '127.0.0.1', () => {
  const issuer = `http://127.0.0.1:${server.address().port}`;
  const provider = new Provider(issuer, {
    clients: [
      ...config.clients.map(({ client_id, client_secret }) => ({
        client_id,
        client_secret,
        grant_types: ['client_credentials'],
        redirect_uris: [],
        response_types: [],
      })),
      ...(config.apps ?? []).map(({ client_id, client_secret }) => ({
        client_id,
        client_secret,
        application_type: 'native',
        grant_types: ['authorization_code', 'urn:ietf:params:oauth:grant-type:device_code'],
        redirect_uris: ['http://127.0.0.1/auth/callback'],
        response_types: ['code'],
        token_endpoint_auth_method: 'client_secret_basic',
      })),
    ],
    jwks: { keys: [signingKey('RS256'), signingKey('ES256')] },
    claims: { openid: ['sub'], email: ['email', 'email_verified'], profile: ['groups'] },
    conformIdTokenClaims: false,
    findAccount: (ctx, id) => {
      const account = accounts.get(id);
      return account && {
        accountId: id,
        claims: () => ({
          sub: id,
          email: account.email,
          email_verified: account.email_verified ?? true,
          groups: account.groups ?? [],
        }),
      };
    },
    ttl: {
      DeviceCode: config.device_code_ttl ?? 600,
    },
    features: {
      devInteractions: { enabled: false },
      deviceFlow: { enabled: true },
      clientCredentials: { enabled: true },
      resourceIndicators: {
        enabled: true,
        getResourceServerInfo: (ctx, resource, client) => ({
          scope: 'assert',
          audience: resource,
          accessTokenFormat: 'jwt',
          accessTokenTTL: 3600,
          jwt: { sign: { alg: clients.get(client.clientId)?.alg ?? 'RS256' } },
        }),
      },
    },
    extraTokenClaims: (ctx, token) => {
      const client = clients.get(token.clientId);
      return client ? { email: client.email, email_verified: true } : undefined;
    },
  });
  // RFC 8628 lets a provider say how often to poll; this one says so when told to.
  provider.use(async (ctx, next) => {
    await next();
    if (ctx.path === '/device/auth' && ctx.body?.device_code && config.device_interval) {
      ctx.body = { ...ctx.body, interval: config.device_interval };
    }
  });
  const callback = provider.callback();
  server.on('request', (req, res) => {
    const url = new URL(req.url, issuer);
    if (/^\/interaction\/[^/]+$/.test(url.pathname)) {
      interaction(provider, url, req, res).catch((e) => {
        res.statusCode = 400;
        res.end(`interaction failed: ${e.message}`);
      });
    } else {
      callback(req, res);
    }
  });
  process.stdout.write(`${JSON.stringify({ issuer })}\n`);
});

// The sign-in page: sign an account in, refuse, or grant consent.
async function interaction(provider, url, req, res) {
  const details = await provider.interactionDetails(req, res);
  if (url.searchParams.get('deny')) {
    await provider.interactionFinished(req, res, {
      error: 'access_denied',
      error_description: 'the person refused the sign-in',
    }, { mergeWithLastSubmission: false });
    return;
  }
  if (details.prompt.name === 'login') {
    const id = url.searchParams.get('account');
    if (!id) {
      const links = [...accounts.keys()]
        .map((a) => `<li><a href="?account=${encodeURIComponent(a)}">${a}</a></li>`).join('');
      res.setHeader('content-type', 'text/html; charset=utf-8');
      res.end(`<!doctype html><title>Sign in</title><link rel="icon" href="data:,"><ul>${links}</ul><a href="?deny=1">Refuse</a>`);
      return;
    }
    if (!accounts.has(id)) throw new Error(`no account ${id}`);
    await provider.interactionFinished(req, res, { login: { accountId: id } }, {
      mergeWithLastSubmission: false,
    });
    return;
  }
  // Consent: everything the app asked for.
  const { prompt: { details: missing }, grantId, session, params } = details;
  const grant = grantId
    ? await provider.Grant.find(grantId)
    : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
  if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(' '));
  if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
  if (missing.missingResourceScopes) {
    for (const [indicator, scope] of Object.entries(missing.missingResourceScopes)) {
      grant.addResourceScope(indicator, scope.join(' '));
    }
  }
  await provider.interactionFinished(req, res, { consent: { grantId: await grant.save() } }, {
    mergeWithLastSubmission: true,
  });
}

process.stdin.on('end', () => process.exit(0));
process.stdin.resume();
