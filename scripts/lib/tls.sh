# Certificates for the test services' TLS listeners (sourced, not run).

# A CA and a server certificate it signed (CN and subjectAltName localhost
# and 127.0.0.1), for TLS on loopback: DIR/ca.crt is what a client verifies
# with; DIR/server.crt and DIR/server.key belong to OWNER, who runs the
# server. Made once. (A self-signed server certificate is a CA certificate,
# which rustls refuses as a server's.)
tls_cert() {
  local dir=$1 owner=$2
  [ -f "$dir/ca.crt" ] && [ -f "$dir/server.crt" ] && return 0
  install -d -o "$owner" -g "$owner" -m 700 "$dir"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=idemq test CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" >/dev/null 2>&1 &&
  openssl req -newkey rsa:2048 -nodes -subj /CN=localhost \
    -keyout "$dir/server.key" -out "$dir/server.csr" >/dev/null 2>&1 &&
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' \
    >"$dir/server.ext" &&
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 3650 -extfile "$dir/server.ext" -out "$dir/server.crt" >/dev/null 2>&1 ||
    { echo "making a TLS certificate in $dir failed" >&2; return 1; }
  chown -R "$owner:$owner" "$dir"
  chmod 600 "$dir/server.key" "$dir/ca.key"
}

# A client certificate signed by DIR's CA (made by tls_cert first), for
# listeners that ask for one (mutual TLS): DIR/client.crt and DIR/client.key,
# CN idemq-client, readable by OWNER; made once. Copied to PUBLISH/client.crt
# and PUBLISH/client.key, beside PUBLISH/root.crt, for the tests.
tls_client_cert() {
  local dir=$1 owner=$2 publish=$3
  if [ ! -f "$dir/client.crt" ]; then
    openssl req -newkey rsa:2048 -nodes -subj /CN=idemq-client \
      -keyout "$dir/client.key" -out "$dir/client.csr" >/dev/null 2>&1 &&
    printf 'basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n' >"$dir/client.ext" &&
    openssl x509 -req -in "$dir/client.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
      -days 3650 -extfile "$dir/client.ext" -out "$dir/client.crt" >/dev/null 2>&1 ||
      { echo "making a client certificate in $dir failed" >&2; return 1; }
    chown "$owner:$owner" "$dir/client.crt" "$dir/client.key"
    chmod 600 "$dir/client.key"
  fi
  mkdir -p "$publish"
  install -m 644 "$dir/client.crt" "$publish/client.crt"
  install -m 600 "$dir/client.key" "$publish/client.key"
}
