import { connect, createServer } from 'node:net';
import type { AddressInfo, Server, Socket } from 'node:net';
import type { Duplex } from 'node:stream';
import { DsecError, validateDisplayInput } from '@dsec/core';
import type { DisplayInput, NetworkPolicyPatch, SandboxEvent, SandboxInfo } from '@dsec/core';
import { ScriptedEdge } from '../scripted-edge.js';
import { addFnCall } from '../fncall-double.js';

/** The smallest valid PNG (1×1, transparent): what the fuzz edge's screen shows. */
const PNG_1X1 = Buffer.from(
  'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==',
  'base64',
);

/**
 * A healthy edge that serves every route of the API, for the fuzzer: the
 * scripted edge's commands, sessions and files, function calls (a double
 * with one pool), a web server on every port (a loopback server that answers
 * 200 `ok` to whatever it gets), a screen, events and network updates. So
 * any 5xx the fuzzer meets is the apiserver's, not a missing piece of the
 * fake. Close it after the run (`close()` stops the web server).
 */
export class FuzzEdge extends ScriptedEdge {
  readonly #web: Server;
  readonly #sockets = new Set<Socket>();
  #webPort = 0;

  private constructor() {
    super();
    this.#web = createServer((socket: Socket) => {
      this.#sockets.add(socket);
      socket.once('close', () => this.#sockets.delete(socket));
      socket.on('error', () => undefined);
      let head = '';
      socket.on('data', (chunk: Buffer) => {
        if (head.includes('\r\n\r\n')) return;
        head += chunk.toString('latin1');
        if (head.includes('\r\n\r\n'))
          socket.end('HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok');
      });
    });
    this.io.connectPort = async (sandboxId: string): Promise<Duplex> => {
      await this.getSandbox(sandboxId);
      return connect(this.#webPort, '127.0.0.1');
    };
  }

  static async start(): Promise<FuzzEdge> {
    const edge = addFnCall(new FuzzEdge());
    edge.fncallDouble.pools = ['python', 'node', 'bash'].map((language) => ({
      language,
      network: false,
      idle: 2,
      busy: 0,
      starting: 0,
      max: 8,
    }));
    await new Promise<void>((resolve) => edge.#web.listen(0, '127.0.0.1', resolve));
    edge.#webPort = (edge.#web.address() as AddressInfo).port;
    return edge;
  }

  async screenshot(id: string): Promise<Buffer> {
    await this.#runningSandbox(id);
    return PNG_1X1;
  }

  async sendInput(id: string, input: DisplayInput): Promise<void> {
    await this.#runningSandbox(id);
    validateDisplayInput(input);
  }

  async updateNetwork(id: string, _patch: NetworkPolicyPatch): Promise<SandboxInfo> {
    return this.#runningSandbox(id);
  }

  async listEvents(id: string): Promise<SandboxEvent[]> {
    await this.getSandbox(id);
    return [];
  }

  async #runningSandbox(id: string): Promise<SandboxInfo> {
    const info = await this.getSandbox(id);
    if (info.state !== 'running')
      throw new DsecError('sandbox_not_running', `sandbox ${id} is ${info.state}`);
    return info;
  }

  /** Stops the web server, cutting any tunnel a request left open (the fuzzer counts those as hangs). */
  close(): Promise<void> {
    for (const s of this.#sockets) s.destroy();
    return new Promise((resolve) => this.#web.close(() => resolve()));
  }
}
