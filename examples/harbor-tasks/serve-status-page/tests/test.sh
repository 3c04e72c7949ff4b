#!/bin/bash
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
# bash's /dev/tcp: the check needs no HTTP client of the image's (nor trusts one).
fetch() {
  local reply
  exec 3<>/dev/tcp/127.0.0.1/8080 || return 1
  printf 'GET /%s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$1" >&3
  reply="$(timeout 5 cat <&3)"
  exec 3<&-
  case "${reply%%$'\r'*}" in *" 200 "*) ;; *) return 1 ;; esac
  printf '%s' "${reply#*$'\r\n\r\n'}"
}
if [ ! -f /app/start-service.sh ]; then
  echo "/app/start-service.sh is missing"; exit 0
fi
timeout 20 bash /app/start-service.sh </dev/null >/tmp/service.log 2>&1 || {
  echo "start-service.sh failed:"; cat /tmp/service.log; exit 0
}
for _ in $(seq 1 50); do
  fetch index.html >/dev/null && break
  sleep 0.2
done
index="$(fetch index.html)" || { echo "nothing answers on 127.0.0.1:8080"; exit 0; }
version="$(fetch version)" || { echo "no /version"; exit 0; }
if printf '%s\n' "$index" | grep -qx 'harbor status: ok' && [ "$version" = "1.4.2" ]; then
  echo "the service answers"
  echo 1 > /logs/verifier/reward.txt
else
  echo "index.html: $index"; echo "version: $version"
fi
