#!/usr/bin/env node
// A stepwatch-schema producer on the OpenTelemetry JavaScript SDK (docs/schema.md): N ranks of
// one synchronous data-parallel job simulated in one Node process, each rank with its own
// MeterProvider, PeriodicExportingMetricReader and OTLP exporter, so each rank's window closes
// at its own instant, as the SDK does in a real job (the ranks start up to one export interval
// apart).
//
// Usage:
//   node producer.js --endpoint URL [options]
//
//   --endpoint URL            OTLP endpoint. http: the base URL (/v1/metrics is appended unless
//                             the URL has a path) or the full metrics URL; grpc: http://host:port
//   --protocol http|grpc      OTLP/HTTP protobuf (the exporter sends its body chunked) or
//                             OTLP/gRPC (grpc-js); default http
//   --temporality delta|cumulative   default delta
//   --compression none|gzip   default none
//   --ranks N                 default 4
//   --job ID                  stepwatch.job.id; default js-job
//   --duration-s S            how long steps are made; default 10
//   --step-ms MS              the healthy step time, also the pace of steps; default 100
//   --phases LIST             default data,forward,backward,optimizer; add communication for
//                             synchronous data parallelism's wait (below)
//   --export-interval-ms MS   each rank's export interval; default 1000
//   --slow-rank R             a straggler rank (default none) ...
//   --slow-from-s T           ... from T seconds after the start (default 0) ...
//   --slow-factor F           ... whose --slow-phase takes F times as long (default 1.5)
//   --slow-phase NAME         default forward
//   --buckets default|seconds the SDK's own default explicit buckets, or a view with buckets
//                             suited to seconds (1 ms .. 10 s)
//   --seed N                  the jitter's seed; default 1
//
// The job: every step each rank spends step-ms split over its phases (data 10 %, forward 30 %,
// backward 40 %, optimizer 10 %, communication 10 %, with 2 % jitter). Synchronous data
// parallelism: every rank's step takes as long as the slowest rank's compute; with
// `communication` among the phases each rank's communication grows by its wait for the
// slowest (a masked straggler: the peers' communication grows, the straggler's own phase
// grows), without it the wait falls outside the phases.
//
// Metrics (docs/schema.md): resource stepwatch.job.id, stepwatch.rank, stepwatch.world_size,
// host.name (8 ranks a node); histograms stepwatch.step.duration and stepwatch.phase.duration
// (attribute stepwatch.phase), unit s; gauge stepwatch.step.last.
//
// At the end every provider is flushed and shut down, and one JSON line is printed:
//   {"ranks", "protocol", "temporality", "steps_per_rank": [...], "exports_attempted",
//    "exports_failed", "step_windows": [[count of each exported step point, in order] per rank],
//    "step_windows_failed": [[the same for failed exports] per rank]}
// With delta temporality a step window's count is its steps; with cumulative, the steps so far.
'use strict';

const { metrics: apiMetrics } = require('@opentelemetry/api');
const {
  AggregationType,
  MeterProvider,
  PeriodicExportingMetricReader,
} = require('@opentelemetry/sdk-metrics');
const { resourceFromAttributes } = require('@opentelemetry/resources');
const httpExporter = require('@opentelemetry/exporter-metrics-otlp-http');
const grpcExporter = require('@opentelemetry/exporter-metrics-otlp-grpc');

const FRACTIONS = { data: 0.1, forward: 0.3, backward: 0.4, optimizer: 0.1, communication: 0.1 };
const SECONDS_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10];

function parseArgs(argv) {
  const options = {
    endpoint: '',
    protocol: 'http',
    temporality: 'delta',
    compression: 'none',
    ranks: 4,
    job: 'js-job',
    durationS: 10,
    stepMs: 100,
    phases: 'data,forward,backward,optimizer',
    exportIntervalMs: 1000,
    slowRank: -1,
    slowFromS: 0,
    slowFactor: 1.5,
    slowPhase: 'forward',
    buckets: 'default',
    seed: 1,
  };
  const names = {
    '--endpoint': ['endpoint', String],
    '--protocol': ['protocol', String],
    '--temporality': ['temporality', String],
    '--compression': ['compression', String],
    '--ranks': ['ranks', Number],
    '--job': ['job', String],
    '--duration-s': ['durationS', Number],
    '--step-ms': ['stepMs', Number],
    '--phases': ['phases', String],
    '--export-interval-ms': ['exportIntervalMs', Number],
    '--slow-rank': ['slowRank', Number],
    '--slow-from-s': ['slowFromS', Number],
    '--slow-factor': ['slowFactor', Number],
    '--slow-phase': ['slowPhase', String],
    '--buckets': ['buckets', String],
    '--seed': ['seed', Number],
  };
  for (let i = 0; i < argv.length; i += 2) {
    const known = names[argv[i]];
    if (!known || i + 1 >= argv.length) throw new Error(`unknown or incomplete option ${argv[i]}`);
    const value = known[1](argv[i + 1]);
    if (typeof value === 'number' && Number.isNaN(value)) throw new Error(`${argv[i]}: not a number`);
    options[known[0]] = value;
  }
  if (!options.endpoint) throw new Error('--endpoint is required');
  if (!['http', 'grpc'].includes(options.protocol)) throw new Error('--protocol: http or grpc');
  if (!['delta', 'cumulative'].includes(options.temporality)) {
    throw new Error('--temporality: delta or cumulative');
  }
  if (!['default', 'seconds'].includes(options.buckets)) throw new Error('--buckets: default or seconds');
  options.phases = options.phases.split(',').filter(Boolean);
  for (const phase of options.phases) {
    if (!(phase in FRACTIONS)) throw new Error(`--phases: unknown phase ${phase}`);
  }
  return options;
}

// mulberry32: a small seeded generator, so runs are repeatable
function random(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function makeExporter(options) {
  const temporalityPreference =
    options.temporality === 'delta'
      ? httpExporter.AggregationTemporalityPreference.DELTA
      : httpExporter.AggregationTemporalityPreference.CUMULATIVE;
  const compression = options.compression;
  if (options.protocol === 'grpc') {
    return new grpcExporter.OTLPMetricExporter({
      url: options.endpoint,
      temporalityPreference,
      compression,
    });
  }
  const url = new URL(options.endpoint);
  if (url.pathname === '/' || url.pathname === '') url.pathname = '/v1/metrics';
  return new httpExporter.OTLPMetricExporter({
    url: url.toString(),
    temporalityPreference,
    compression,
  });
}

function stepCounts(resourceMetrics) {
  const counts = [];
  for (const scope of resourceMetrics.scopeMetrics) {
    for (const metric of scope.metrics) {
      if (metric.descriptor.name !== 'stepwatch.step.duration') continue;
      for (const point of metric.dataPoints) counts.push(point.value.count);
    }
  }
  return counts;
}

class Rank {
  constructor(rank, options, totals) {
    this.rank = rank;
    this.steps = 0;
    this.windows = [];
    this.failedWindows = [];
    const exporter = makeExporter(options);
    const exportOnce = exporter.export.bind(exporter);
    exporter.export = (resourceMetrics, done) => {
      totals.attempted += 1;
      const counts = stepCounts(resourceMetrics);
      exportOnce(resourceMetrics, (result) => {
        if (result.code !== 0) {
          totals.failed += 1;
          this.failedWindows.push(...counts);
        } else {
          this.windows.push(...counts);
        }
        done(result);
      });
    };
    const views = [];
    if (options.buckets === 'seconds') {
      for (const name of ['stepwatch.step.duration', 'stepwatch.phase.duration']) {
        views.push({
          instrumentName: name,
          aggregation: {
            type: AggregationType.EXPLICIT_BUCKET_HISTOGRAM,
            options: { boundaries: SECONDS_BUCKETS },
          },
        });
      }
    }
    this.provider = new MeterProvider({
      resource: resourceFromAttributes({
        'stepwatch.job.id': options.job,
        'stepwatch.rank': rank,
        'stepwatch.world_size': options.ranks,
        'host.name': `node-${Math.floor(rank / 8)}`,
      }),
      views,
      readers: [
        new PeriodicExportingMetricReader({
          exporter,
          exportIntervalMillis: options.exportIntervalMs,
          exportTimeoutMillis: Math.min(options.exportIntervalMs, 30000),
        }),
      ],
    });
    const meter = this.provider.getMeter('stepwatch.interop.js', '0.1.0');
    this.step = meter.createHistogram('stepwatch.step.duration', { unit: 's' });
    this.phase = meter.createHistogram('stepwatch.phase.duration', { unit: 's' });
    this.last = meter.createGauge('stepwatch.step.last', { unit: '{step}' });
  }

  record(index, stepS, phases) {
    for (const [name, seconds] of Object.entries(phases)) {
      this.phase.record(seconds, { 'stepwatch.phase': name });
    }
    this.step.record(stepS);
    this.last.record(index);
    this.steps += 1;
  }
}

async function main() {
  const options = parseArgs(process.argv.slice(2));
  const uniform = random(options.seed);
  const jitter = () => 1 + (uniform() - 0.5) * 0.04;
  const totals = { attempted: 0, failed: 0 };
  const ranks = new Array(options.ranks).fill(null);
  const started = Date.now();
  // each rank's reader starts at its own instant within the first interval
  const starting = ranks.map(
    (_, rank) =>
      new Promise((resolve) => {
        setTimeout(() => {
          ranks[rank] = new Rank(rank, options, totals);
          resolve();
        }, Math.floor(uniform() * options.exportIntervalMs));
      }),
  );
  let index = 0;
  const base = options.stepMs / 1000;
  const stepOnce = () => {
    const elapsedS = (Date.now() - started) / 1000;
    const compute = ranks.map((_, rank) => {
      const phases = {};
      for (const name of options.phases) {
        if (name === 'communication') continue;
        let seconds = base * FRACTIONS[name] * jitter();
        if (rank === options.slowRank && name === options.slowPhase && elapsedS >= options.slowFromS) {
          seconds *= options.slowFactor;
        }
        phases[name] = seconds;
      }
      return phases;
    });
    const sums = compute.map((phases) => Object.values(phases).reduce((a, b) => a + b, 0));
    const slowest = Math.max(...sums);
    const talk = options.phases.includes('communication') ? base * FRACTIONS.communication : 0;
    ranks.forEach((rank, r) => {
      if (rank === null) return;
      const phases = compute[r];
      if (talk) phases.communication = talk * jitter() + (slowest - sums[r]);
      rank.record(index, slowest + talk, phases);
    });
    index += 1;
  };
  const timer = setInterval(stepOnce, options.stepMs);
  await new Promise((resolve) => setTimeout(resolve, options.durationS * 1000));
  clearInterval(timer);
  await Promise.all(starting);
  for (const rank of ranks) {
    await rank.provider.forceFlush().catch(() => undefined);
  }
  for (const rank of ranks) {
    await rank.provider.shutdown().catch(() => undefined);
  }
  apiMetrics.disable();
  process.stdout.write(
    JSON.stringify({
      ranks: options.ranks,
      protocol: options.protocol,
      temporality: options.temporality,
      steps_per_rank: ranks.map((rank) => rank.steps),
      exports_attempted: totals.attempted,
      exports_failed: totals.failed,
      step_windows: ranks.map((rank) => rank.windows),
      step_windows_failed: ranks.map((rank) => rank.failedWindows),
    }) + '\n',
  );
}

main().catch((error) => {
  process.stderr.write(`producer: ${error.stack || error}\n`);
  process.exit(2);
});
