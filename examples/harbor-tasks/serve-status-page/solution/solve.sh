#!/bin/bash
set -euo pipefail
mkdir -p /srv/www /app
printf 'harbor status: ok\n' > /srv/www/index.html
printf '1.4.2\n' > /srv/www/version
cat > /app/start-service.sh <<'SH'
#!/bin/bash
# busybox httpd daemonizes itself unless -f is given.
exec busybox httpd -p 127.0.0.1:8080 -h /srv/www
SH
chmod +x /app/start-service.sh
