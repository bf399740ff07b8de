//! How the server and the agent declare their Prometheus series: `metrics!` turns a struct of
//! typed metrics into one that registers each under its prefix and field name, with the field's
//! doc comment as its HELP text, so a series is named and described in one place.

pub use prometheus;
use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts,
};

/// A metric type `metrics!` can build from its name, HELP, labels and buckets.
pub trait Metric: Clone + prometheus::core::Collector + 'static {
    fn build(name: &str, help: &str, labels: &[&str], buckets: Option<Vec<f64>>) -> Self;
}

fn histogram_opts(name: &str, help: &str, buckets: Option<Vec<f64>>) -> HistogramOpts {
    let opts = HistogramOpts::new(name, help);
    match buckets {
        Some(b) => opts.buckets(b),
        None => opts,
    }
}

impl Metric for IntCounter {
    fn build(name: &str, help: &str, _: &[&str], _: Option<Vec<f64>>) -> Self {
        IntCounter::with_opts(Opts::new(name, help)).expect("valid metric")
    }
}

impl Metric for IntGauge {
    fn build(name: &str, help: &str, _: &[&str], _: Option<Vec<f64>>) -> Self {
        IntGauge::with_opts(Opts::new(name, help)).expect("valid metric")
    }
}

impl Metric for Gauge {
    fn build(name: &str, help: &str, _: &[&str], _: Option<Vec<f64>>) -> Self {
        Gauge::with_opts(Opts::new(name, help)).expect("valid metric")
    }
}

impl Metric for IntGaugeVec {
    fn build(name: &str, help: &str, labels: &[&str], _: Option<Vec<f64>>) -> Self {
        IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
    }
}

impl Metric for GaugeVec {
    fn build(name: &str, help: &str, labels: &[&str], _: Option<Vec<f64>>) -> Self {
        GaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
    }
}

impl Metric for IntCounterVec {
    fn build(name: &str, help: &str, labels: &[&str], _: Option<Vec<f64>>) -> Self {
        IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
    }
}

impl Metric for Histogram {
    fn build(name: &str, help: &str, _: &[&str], buckets: Option<Vec<f64>>) -> Self {
        Histogram::with_opts(histogram_opts(name, help, buckets)).expect("valid metric")
    }
}

impl Metric for HistogramVec {
    fn build(name: &str, help: &str, labels: &[&str], buckets: Option<Vec<f64>>) -> Self {
        HistogramVec::new(histogram_opts(name, help, buckets), labels).expect("valid metric")
    }
}

/// A struct of metrics, each registered as `<prefix><field>` with its doc comment as HELP;
/// `new(&registry)` builds and registers them all.
#[macro_export]
macro_rules! metrics {
    (
        $(#[$meta:meta])*
        pub struct $name:ident($prefix:literal) {
            $(
                #[doc = $help:literal]
                pub $field:ident: $ty:ty
                    $(, labels = [$($label:literal),+])?
                    $(, buckets = $buckets:expr)?
            ;)*
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $(#[doc = $help] pub $field: $ty,)*
        }

        impl $name {
            pub fn new(registry: &$crate::metrics::prometheus::Registry) -> Self {
                $name {
                    $($field: {
                        let labels: &[&str] = &[$($($label),+)?];
                        let buckets: Option<Vec<f64>> = None $(.or(Some($buckets)))?;
                        let m = <$ty as $crate::metrics::Metric>::build(
                            concat!($prefix, stringify!($field)),
                            $help.trim(),
                            labels,
                            buckets,
                        );
                        registry.register(Box::new(m.clone())).expect("unique metric names");
                        m
                    },)*
                }
            }
        }
    };
}
