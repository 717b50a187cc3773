#!/usr/bin/env bash
# A throwaway CA and certificates for the mesh's TLS / mTLS (tests, local trials; not for production).
#
#   scripts/make_test_ca.sh DIR [SAN ...]
#
# Writes into DIR (created if missing), all PEM, valid 30 days, ECDSA P-256:
#   ca.pem, ca.key            the CA (--tls-ca on clients, --tls-client-ca on mTLS servers)
#   server.pem, server.key    a server certificate (--tls-cert/--tls-key) for localhost and 127.0.0.1
#                             plus each extra SAN given (a name, or an IPv4/IPv6 address); its usage
#                             allows client auth too, so a service can present it as --tls-client-cert
#   client.pem, client.key    a client-only certificate (--tls-client-cert/--tls-client-key)
# Needs openssl (1.1.1 or later). Keys are written mode 600.
set -euo pipefail

dir=${1:?usage: $0 DIR [SAN ...]}
shift
mkdir -p "$dir"
umask 077

sans="DNS:localhost,IP:127.0.0.1"
for san in "$@"; do
    if [[ $san =~ ^[0-9.]+$ || $san == *:* ]]; then sans+=",IP:$san"; else sans+=",DNS:$san"; fi
done

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# sign NAME CN EXTENSIONS: DIR/NAME.key and a certificate DIR/NAME.pem signed by the CA.
sign() {
    local name=$1 cn=$2 ext=$3
    newkey "$dir/$name.key"
    openssl req -new -key "$dir/$name.key" -subj "/CN=$cn" -out "$dir/$name.csr"
    printf '%b' "$ext" > "$dir/$name.ext"
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
        -set_serial "0x$(openssl rand -hex 8)" -days 30 -sha256 -extfile "$dir/$name.ext" \
        -out "$dir/$name.pem" 2>/dev/null
    rm -f "$dir/$name.csr" "$dir/$name.ext"
}

newkey "$dir/ca.key"
openssl req -x509 -new -key "$dir/ca.key" -subj "/CN=radixmesh test CA" -days 30 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/ca.pem"

leaf="basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
sign server localhost "${leaf}extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=$sans\n"
sign client radixmesh-client "${leaf}extendedKeyUsage=clientAuth\n"
chmod 644 "$dir/ca.pem" "$dir/server.pem" "$dir/client.pem"
echo "CA and certificates in $dir (server SANs: $sans)"
