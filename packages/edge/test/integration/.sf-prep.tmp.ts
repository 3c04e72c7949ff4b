import { join } from 'node:path';
import { DirImageStore } from '@dsec/images';
import { prepareFnCallImages } from '@dsec/edge';
const dir = '/var/tmp/sfusion-it';
const store = new DirImageStore(join(dir, 'images'));
const r = await prepareFnCallImages(store, { cacheDir: join(dir, 'cache'), images: (process.argv[2] ?? 'fncall-node,fncall-sf-gcc').split(',') , onProgress: (p) => console.log(JSON.stringify(p)) });
console.log('built', r.built);
