// The paper's minimal session with @dsec/sdk, installed from its tarball
// (see README.md). Settings from DSEC_URL and DSEC_API_KEY; the image from
// DSEC_IMAGE (default busybox).
import { DSecClient, isDsecError } from '@dsec/sdk';

const client = new DSecClient();
try {
  const who = await client.open();
  console.log(`key ${who.keyId} of project ${who.projectId}`);
  const sandbox = await client.runContainer(
    {
      image: process.env.DSEC_IMAGE ?? 'busybox',
      memoryLimitMb: 512,
      cpuCoresLimit: 1,
      ttlRunningStopSeconds: 300,
      networkRules: {},
      initUser: 'root',
    },
    { timeoutMs: 120_000 },
  );
  try {
    const result = await sandbox.runShell('echo hello from outside');
    console.log(`exit ${result.exitCode}: ${result.stdout.trim()}`);
    await sandbox.exec(['echo', 'streamed'], { onStdout: (text) => process.stdout.write(text) });
    await sandbox.files.write('/tmp/note.txt', 'written from outside\n');
    console.log(`read back: ${(await sandbox.files.read('/tmp/note.txt')).trim()}`);
  } finally {
    await sandbox.stop();
  }
  console.log('stopped');
} catch (err) {
  // Every failure is a DsecError with a stable code.
  console.error(isDsecError(err) ? `${err.code}: ${err.message}` : err);
  process.exitCode = 1;
} finally {
  client.close();
}
