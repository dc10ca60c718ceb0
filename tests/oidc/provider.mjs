// A real OpenID provider (node-oidc-provider, OpenID-certified) for Skiff's tests, on loopback.
//
//   node provider.mjs CONFIG.json
//
// CONFIG: { "clients": [ { "client_id", "client_secret", "email", "alg" } ] }. Each client may
// use the client-credentials grant for a resource (`resource=<absolute URI>`): the access token
// it gets is a JWT signed by this provider's key for `alg` (RS256 or ES256), with the resource
// as its audience and the client's `email` (a string, or a list to test a multi-valued claim)
// as a claim — what an identity-aware proxy's assertion looks like. Keys are made fresh at each
// start, so two providers never share a signer. Prints one JSON line, {"issuer": URL}, once it
// listens; stops when its standard input closes (the test that started it is gone).

import { readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { generateKeyPairSync, randomUUID } from 'node:crypto';
import Provider from 'oidc-provider';

const config = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const clients = new Map(config.clients.map((c) => [c.client_id, c]));

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
    clients: config.clients.map(({ client_id, client_secret }) => ({
      client_id,
      client_secret,
      grant_types: ['client_credentials'],
      redirect_uris: [],
      response_types: [],
    })),
    jwks: { keys: [signingKey('RS256'), signingKey('ES256')] },
    features: {
      devInteractions: { enabled: false },
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
  server.on('request', provider.callback());
  process.stdout.write(`${JSON.stringify({ issuer })}\n`);
});

process.stdin.on('end', () => process.exit(0));
process.stdin.resume();
